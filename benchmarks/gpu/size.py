"""GPU check, size part: the largest Llama each engine trains with CPU offload, within the host's memory.

For each offload mode (ZeRO-2 + optimizer offload; ZeRO-3 + optimizer and parameter offload)
and each engine (zerotrain, DeepSpeed with the same config), search the ladder of Llama sizes
(steps of ~1B parameters, size_ladder.py) for the largest that trains 3 steps (bf16, seq 2048,
micro-batch 1, gradient checkpointing, one GPU = a world of one), with tokens/s at every size
tried; the planner's predicted largest stands beside the measured one.

    python benchmarks/gpu/size.py --out-dir runs/gpu-check          # on the GPU machine
    GPU_CHECK_DRY=1 python benchmarks/gpu/size.py --out-dir /tmp/x  # dry: CPU, Gloo, ~1M-param steps

Writes OUT_DIR/size.json and OUT_DIR/size.md (and small trial logs under OUT_DIR/size-logs/).
Every trial runs in a fresh, watched process (size_watch.py): an OOM, a host-memory overrun or a
hang ends that trial only. A wall-clock budget (--budget-s) bounds the whole run: the search
stops trying sizes it has no time for and reports what it reached.
Exit status: 0 when the search ran (a missed target is reported, not an exit code); 1 when
zerotrain trained no size in some mode; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from size_ladder import MODES, ladder
from size_launch import Limits, python_has
from size_schedule import Schedule
from size_search import Search
from size_watch import meminfo

GIB, MIB = 2**30, 2**20
# Dry mode: what a CPU trial's process allocates beyond model states and activations at any size
# (allocator arenas, autograd and module objects, Gloo); ~120-130 MiB measured on the 2-core CI
# machine. The planner models a GPU job, so in dry mode its host limit is the fake one less this.
DRY_OVERHEAD_BYTES = 140 * MIB


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--dry", action="store_true", help="CPU dry run (also GPU_CHECK_DRY=1)")
    p.add_argument("--engines", default="zerotrain,deepspeed", help="comma list (default: both)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--budget-s", type=float, help="wall-clock budget of the whole run (default 480; dry 120: the "
                   "search ends at the first failing size, well before that on an idle machine)")
    p.add_argument("--trial-timeout-s", type=float, help="limit of one trial (default 200; dry 30)")
    p.add_argument("--max-size", type=int, help="ladder top, in units (default 24 B; dry 12 M)")
    p.add_argument("--seq", type=int, help="sequence length (default 2048; dry 64)")
    p.add_argument("--steps", type=int, default=3, help="steps per trial; tokens/s over steps 2.. (default 3)")
    p.add_argument("--host-limit-gib", type=float,
                   help="GPU: cap the host memory a trial may take below what is available; "
                        "dry: the fake host limit on a trial's RSS growth (default 0.1875 GiB = 192 MiB)")
    p.add_argument("--stage3-build", choices=["device", "init"], default="device",
                   help="how the ZeRO-3 mode builds the model: device (default: on the GPU in bf16, as stage 2, then "
                        "initialize offloads it) or init (under each engine's zero.Init; zerotrain's replays the "
                        "initializers on the CPU, about a minute per billion parameters)")
    p.add_argument("--no-refuse", action="store_true", help="run every size, even one whose host memory, "
                   "extrapolated from the sizes that trained, is over the limit")
    p.add_argument("--deepspeed-python", default=sys.executable,
                   help="the interpreter of the DeepSpeed trials (default: this one)")
    args = p.parse_args(argv)
    args.dry = args.dry or os.environ.get("GPU_CHECK_DRY", "") not in ("", "0")
    d = args.dry
    args.budget_s = args.budget_s or (120.0 if d else 480.0)  # dry: a loaded 2-core CI needs ~2x
    args.trial_timeout_s = args.trial_timeout_s or (30.0 if d else 200.0)
    args.max_size = args.max_size or (12 if d else 24)
    args.seq = args.seq or (64 if d else 2048)
    args.engines = [e for e in args.engines.split(",") if e]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [e for e in args.engines if e not in ("zerotrain", "deepspeed")] + [m for m in args.modes if m not in MODES]
    if bad or not args.engines or not args.modes:
        p.error(f"unknown or empty --engines/--modes: {bad}")
    return args


def machine(args) -> dict:
    """The device (from a child process: this one never holds a CUDA context), host memory, versions."""
    info = meminfo()
    facts = {"host_mem_total_bytes": info["MemTotal"], "host_mem_available_bytes": info["MemAvailable"],
             "cores": os.cpu_count() or 1, "python": sys.version.split()[0], "commit": _commit()}
    if args.dry:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        import importlib.metadata as md

        versions = {}
        for pkg in ("torch", "transformers", "zerotrain", "deepspeed"):
            try:
                versions[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                versions[pkg] = None
        return {**facts, "cuda": False, "device": f"CPU ({facts['cores']} cores: {cpu})", "gpu_total_bytes": None,
                "versions": versions}
    trial = Path(__file__).resolve().parent / "size_trial.py"
    out = subprocess.run([sys.executable, str(trial), "--probe"], check=False, capture_output=True, text=True, timeout=120)
    probe = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    if not probe.get("cuda"):
        sys.exit("size.py: no CUDA device (for a CPU dry run: --dry or GPU_CHECK_DRY=1)\n" + out.stderr[-2000:])
    return {**facts, "cuda": True, "device": probe["device"], "gpu_total_bytes": probe["gpu_total_bytes"],
            "versions": probe["versions"], "cuda_version": probe.get("cuda_version")}


def _commit() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "zerotrain"],
                               check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else None


def limits_for(args, facts: dict) -> Limits:
    total, available = facts["host_mem_total_bytes"], facts["host_mem_available_bytes"]
    # Past this the machine would swap or wake the kernel's OOM killer; the watcher kills the trial first.
    floor = max(2 * GIB, int(total * 0.025))
    if args.dry:
        rss = int((args.host_limit_gib or 192 / 1024) * GIB)
        return Limits(floor, rss, rss, args.trial_timeout_s)
    if args.host_limit_gib:
        floor = max(floor, available - int(args.host_limit_gib * GIB))
    return Limits(floor, available - floor, None, args.trial_timeout_s)


def predictions(args, facts: dict, limits: Limits, sizes) -> dict:
    """Per mode: zerotrain's planner and DeepSpeed's estimator, for this machine's GPU and a trial's host limit."""
    from size_plan import deepspeed_predict, predict

    # The memory a trial may really take (MemAvailable less the floor), not MemTotal: the 2026-11-26
    # H100 run started at a 9B the planner fitted in MemTotal and the trial's limit did not hold.
    host = limits.host_limit_bytes - (DRY_OVERHEAD_BYTES if args.dry else 0)
    out = {}
    for mode in args.modes:
        out[mode] = predict(sizes, mode, args.seq, 1, facts["gpu_total_bytes"], host, cpu_device=args.dry)
        out[mode]["host_memory_bytes"] = host
        out[mode]["deepspeed_estimator"] = deepspeed_predict(sizes, mode, facts["gpu_total_bytes"], host, args.dry)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    log_dir = args.out_dir / "size-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    facts = machine(args)
    sizes = ladder(args.dry, args.max_size)
    limits = limits_for(args, facts)
    print(f"[size] {facts['device']}; host {facts['host_mem_total_bytes'] / GIB:.1f} GiB total, trial limit "
          f"{limits.host_limit_bytes / GIB:.2f} GiB; budget {args.budget_s:.0f} s", flush=True)
    plan = predictions(args, facts, limits, sizes)
    for mode, p in plan.items():
        print(f"[size] {mode}: largest that fits: zerotrain's planner {p['largest']}, DeepSpeed's estimator "
              f"{p['deepspeed_estimator']['largest']}", flush=True)
    engines, notes = list(args.engines), []
    if "deepspeed" in engines and not python_has(args.deepspeed_python, "deepspeed"):
        engines.remove("deepspeed")
        notes.append(f"DeepSpeed skipped: not importable by {args.deepspeed_python}")
        print(f"[size] {notes[-1]}", flush=True)
    # Each engine starts at its own prediction: zerotrain at its planner's, DeepSpeed at its estimator's;
    # DeepSpeed's estimator (1.5x its model states) is the safe size to drop to after a first failure.
    # zerotrain's searches run first: they are the product.
    searches = []
    for engine in engines:
        for mode in args.modes:
            planner, estimator = plan[mode]["largest_index"], plan[mode]["deepspeed_estimator"]["largest_index"]
            zt = engine == "zerotrain"
            searches.append(Search(mode, engine, sizes, (planner if zt else estimator) or 1,
                                   "zerotrain's planner" if zt else "DeepSpeed's estimator", safe=estimator or 1,
                                   host_limit_bytes=None if args.dry else limits.host_limit_bytes))
    Schedule(args, facts, limits, plan, sizes, log_dir, t0, lambda rec: print(f"[size] {_progress(rec)}", flush=True)
             ).run(searches)
    elapsed = time.monotonic() - t0
    from size_report import write_outputs

    command = "python benchmarks/gpu/size.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.dry:
        command = "GPU_CHECK_DRY=1 " + command
    write_outputs(args, facts, limits, sizes, plan, searches, notes, elapsed, command)
    print(f"[size] wrote {args.out_dir / 'size.json'} and {args.out_dir / 'size.md'} in {elapsed:.0f} s", flush=True)
    bad = [s for s in searches if s.engine == "zerotrain" and not s.ok() and s.trials and not (s.done or "").startswith("budget")]
    return 1 if bad else 0


def _progress(r: dict) -> str:
    params = f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.2f}M"
    head = (f"{r['mode']} {r['engine']} {r['size']} ({params} params)"
            + (", comparison" if r.get("comparison") else "") + ": ")
    if r["status"] == "ok":
        gpu = f", GPU peak {r['gpu_peak_bytes'] / GIB:.1f} GiB" if r.get("gpu_peak_bytes") else ""
        return (head + f"ok, {r['tokens_per_s']:.0f} tokens/s, host peak {r['host_peak_bytes'] / GIB:.3g} GiB"
                + gpu + f", {r['wall_s']:.0f} s")
    return head + f"FAILED ({r['reason']}): {str(r.get('detail', ''))[-200:]}, {r['wall_s']:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
