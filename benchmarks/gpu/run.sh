#!/usr/bin/env bash
# The GPU check, one part per call:  benchmarks/gpu/run.sh correct|speed|size|multi|longseq|all [PART ARGS...]
#
# On the GPU machine (no network; see docs/gpu.md): installs the wheels carried in .whl/ into a
# folder of their own, installs zerotrain from this tree (with its `zerotrain` command), runs the
# part, and leaves PART.json, PART.md, PART.log (and PART-logs.tar.gz) in $OUT, or runs/gpu/.
# GPU_CHECK_DRY=1: the same steps on a CPU machine with tiny sizes and Gloo (what CI runs).
#   PYTHON        the interpreter to check (default python3: on the GPU machine, the one with torch)
#   GPU_CHECK_SITE  where the wheels are installed (default /tmp/zerotrain-gpu-site)
set -euo pipefail
cd "$(dirname "$0")/../.."

part=${1:-}
shift || true
case "$part" in
  correct|speed|size|multi|longseq|all) ;;
  *) echo "usage: benchmarks/gpu/run.sh correct|speed|size|multi|longseq|all [PART ARGS...]   (docs/gpu.md)" >&2; exit 2 ;;
esac
if [ "$part" = all ] && [ $# -gt 0 ]; then
  echo "run.sh all takes no part arguments: name one part to pass them to it" >&2; exit 2
fi
PYTHON=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
RESULTS=${OUT:-runs/gpu}
SITE=${GPU_CHECK_SITE:-/tmp/zerotrain-gpu-site}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1

say() { echo "[gpu-check] $*"; }

if [ "$DRY" != 1 ] && ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA GPU is visible to $PYTHON: run this on the GPU machine, or set GPU_CHECK_DRY=1 for the CPU rehearsal" >&2
  exit 2
fi

# --- 1. the wheels the GPU machine lacks (made by `make gpu-wheels`) --------------------------
# The same pip line here and there: platform flags name the GPU machine's Python (3.12, manylinux
# x86_64), so on a CPU machine with another Python the line still installs the very same files.
install_wheels() {  # FOLDER TARGET
  local folder=$1 target=$2
  compgen -G "$folder/*.whl" >/dev/null || return 0
  rm -rf "$target"
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --target "$target" "$folder"/*.whl
  say "installed $(ls "$folder"/*.whl | wc -l) wheels from $folder into $target"
}

if [ ! -f .whl/manifest.json ]; then
  echo "no .whl/manifest.json: run \`make gpu-wheels\` on a machine with network, and carry .whl (docs/gpu.md)" >&2
  exit 2
fi
install_wheels .whl "$SITE/base"
case "$part" in speed|size|multi|all) install_wheels .whl/deepspeed "$SITE/deepspeed" ;; esac

if [ "$DRY" = 1 ]; then
  # The wheels are for Python 3.12: check they landed, but run on this interpreter's own packages.
  "$PYTHON" - "$SITE" <<'EOF'
import json, pathlib, sys
site = pathlib.Path(sys.argv[1])
wheels = json.loads(pathlib.Path(".whl/manifest.json").read_text())["wheels"]
norm = lambda name: name.lower().replace("-", "_").replace(".", "_")
folders = {"zerotrain": site / "base", "comparison": site / "deepspeed"}  # wheel_plan.GROUP_DIRS's groups
missing, checked = [], 0
for group, folder in folders.items():
    if not folder.is_dir():
        continue  # this part installs no such group
    installed = {norm(p.name.split("-")[0]) for p in folder.glob("*.dist-info")}
    for w in wheels:
        if w["group"] == group:
            checked += 1
            if norm(w["distribution"]) not in installed:
                missing.append(w["file"])
if missing:
    sys.exit(f"[gpu-check] the install line did not install: {missing}")
print(f"[gpu-check] dry run: all {checked} wheels of the manifest installed; not put on the path (they are for Python 3.12)")
EOF
else
  export PYTHONPATH="$SITE/base${PYTHONPATH:+:$PYTHONPATH}"
  # --- 2. zerotrain from this tree, with the `zerotrain` command beside the interpreter ---------
  if ! "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e . ; then
    echo "pip could not install zerotrain from this tree (see above)" >&2
    exit 2
  fi
fi
"$PYTHON" -c "import zerotrain, pydantic, hjson; print('[gpu-check] zerotrain', zerotrain.__version__, 'from', zerotrain.__file__)"

# --- 3. the parts ------------------------------------------------------------------------------
status=0
run_part() {  # PART [ARGS...]: its output goes to the terminal and to $RESULTS/PART.log
  local name=$1 rc=0
  shift
  local extra_path=""
  if [ "$name" != correct ] && [ "$DRY" != 1 ] && [ -d "$SITE/deepspeed" ]; then
    extra_path="$SITE/deepspeed:"  # DeepSpeed only for the comparisons: tests assert it is absent
  fi
  say "part $name -> $RESULTS"
  PYTHONPATH="$extra_path${PYTHONPATH:-}" "$PYTHON" "benchmarks/gpu/$name.py" --out-dir "$RESULTS" "$@" \
    2>&1 | tee "$RESULTS/$name.log" || rc=$?
  # Scratch a part left beside its results travels as one archive ($OUT brings back few files).
  if [ -d "$RESULTS/$name-logs" ]; then
    tar -czf "$RESULTS/$name-logs.tar.gz" -C "$RESULTS" "$name-logs" && rm -rf "${RESULTS:?}/$name-logs"
  fi
  say "part $name: exit $rc; results $RESULTS/$name.md"
  [ "$rc" = 0 ] || status=$rc
}

if [ "$part" = all ]; then
  for p in correct speed size multi longseq; do run_part "$p"; done
else
  run_part "$part" "$@"
fi
exit $status
