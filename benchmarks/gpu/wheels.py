#!/usr/bin/env python3
"""`make gpu-wheels` (issue 22): fetches the GPU check kit's wheels, the plan in wheel_plan.py.

    .venv/bin/python benchmarks/gpu/wheels.py --dest .whl          # download/build what is missing
    .venv/bin/python benchmarks/gpu/wheels.py --dest .whl --check  # offline: plan vs manifest

DEST/*.whl is zerotrain's group (installed for every GPU check part). DEST/deepspeed/*.whl is the
comparison group, DeepSpeed and what only it needs, installed only for the speed/size comparisons
because some tests assert that DeepSpeed is NOT importable. DEST/manifest.json lists each wheel
(file, distribution, version, group, size, sha256). A second run finds every wheel and downloads
nothing. Needs pip and PyPI, and torch in this Python to build DeepSpeed (so: .venv/bin/python).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # wheel_plan, also when imported by path
import wheel_plan as plan  # noqa: E402


def log(msg: str) -> None:
    """A progress line, flushed at once so that it interleaves with pip's own output."""
    print(f"[gpu-wheels] {msg}", flush=True)


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    """Runs this interpreter's pip; a failure stops the script with pip's own message above it."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    if subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode:
        sys.exit(f"error: failed: {' '.join(cmd)}\n(see pip's output above; PyPI must be reachable)")


def build_wheel(name: str, version: str, folder: Path) -> None:
    """Builds `name==version` from its sdist with this interpreter's torch; checks it is pure Python."""
    try:
        import torch  # noqa: F401  (DeepSpeed's setup.py imports it: no build isolation)
    except ImportError:
        sys.exit(f"error: building {name} needs torch in {sys.executable}: run this with .venv/bin/python")
    with tempfile.TemporaryDirectory() as tmp:
        # --no-cache-dir: pip's wheel cache could hand back a build made with other DS_* settings
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-cache-dir",
            "--no-binary", name, "-w", tmp, f"{name}=={version}", env=plan.SDIST_BUILDS[name])
        (built,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(built) as zf:
            native = [n for n in zf.namelist() if n.endswith((".so", ".pyd", ".dll", ".dylib"))]
        if not built.name.endswith("-py3-none-any.whl") or native:
            sys.exit(f"error: {built.name} is not pure Python ({native[:3]}); "
                     f"its build settings are {plan.SDIST_BUILDS[name]}")
        shutil.move(str(built), folder / built.name)


def fetch(dest: Path) -> int:
    """Downloads or builds every planned wheel missing under DEST; returns how many it added."""
    added = 0
    for group, folder_name in plan.GROUP_DIRS.items():
        folder = dest / folder_name
        folder.mkdir(parents=True, exist_ok=True)
        todo = [(n, v) for n, v, g in plan.pinned() if g == group and not plan.wheel_path(dest, n, v, g)]
        for n, v in [t for t in todo if t[0] in plan.SDIST_BUILDS]:
            log(f"building {n}=={v} from its sdist (pure Python, no ops) into {folder}")
            build_wheel(n, v, folder)
        wheels = [f"{n}=={v}" for n, v in todo if n not in plan.SDIST_BUILDS]
        if wheels:
            log(f"downloading {len(wheels)} wheel(s) into {folder}: {' '.join(wheels)}")
            pip("download", "-q", "--no-deps", "--only-binary=:all:", *plan.TARGET, "-d", str(folder), *wheels)
        added += len(todo)
    return added


def prune(dest: Path) -> None:
    """Removes wheels that are not in the plan (an older pin): two versions would stop the install."""
    keep = {plan.wheel_path(dest, n, v, g) for n, v, g in plan.pinned()}
    for folder in {dest / f for f in plan.GROUP_DIRS.values()}:
        for path in sorted(folder.glob("*.whl")):
            if path not in keep:
                log(f"removing {path}: not in the plan")
                path.unlink()


def manifest(dest: Path, trusted: list[str]) -> dict:
    """DEST's manifest as the files are: each planned wheel's file, distribution, version, group,
    size and sha256, their total, the platforms, and the requirements taken on trust."""
    wheels = []
    for name, version, group in plan.pinned():
        path = plan.wheel_path(dest, name, version, group)
        if path is None:
            sys.exit(f"error: {name}=={version} is missing from {dest / plan.GROUP_DIRS[group]}: "
                     f"run benchmarks/gpu/wheels.py --dest {dest}")
        wheels.append({"file": path.relative_to(dest).as_posix(), "distribution": name,
                       "version": version, "group": group, "size": path.stat().st_size,
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    total = sum(w["size"] for w in wheels)
    return {"wheels": wheels, "total_bytes": total, "platforms": list(plan.PLATFORMS), "unverified": trusted}


def size_errors(data: dict) -> list[str]:
    """An error naming the biggest wheels when the kit is over what one device call carries."""
    if data["total_bytes"] <= plan.MAX_BYTES:
        return []
    big = sorted(data["wheels"], key=lambda w: -w["size"])[:5]
    names = ", ".join(f"{w['file']} ({w['size'] / 2**20:.1f} MiB)" for w in big)
    return [f"the kit is {data['total_bytes'] / 2**20:.1f} MiB, over {plan.MAX_BYTES / 2**20:.0f} MiB; "
            f"biggest: {names}. Pin smaller versions or drop a dependency."]


def report(errors: list[str], trusted: list[str]) -> int:
    """Prints the requirements taken on trust and the errors; returns the exit status."""
    for line in trusted:
        log(f"unverified (check on the GPU machine): {line}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def check(dest: Path) -> int:
    """Offline: the plan against pyproject and the machine list, then DEST's manifest if there is
    one (the same plan, the files present with their sizes and hashes, the total under the cap)."""
    errors, trusted = plan.walk(plan.read_machine_packages(), dest)
    manifest_file = dest / "manifest.json"
    if manifest_file.exists():
        recorded = json.loads(manifest_file.read_text())
        complete = all(plan.wheel_path(dest, *row) for row in plan.pinned())
        current = manifest(dest, trusted) if complete else None
        if current != recorded:
            errors.append(f"{manifest_file} does not match the plan and the files: "
                          f"run benchmarks/gpu/wheels.py --dest {dest}")
        errors += size_errors(current) if current else []
    else:
        log(f"no {manifest_file}: checked the plan against pyproject.toml and the machine list only")
    status = report(errors, trusted)
    log("check: OK" if not errors else f"check: {len(errors)} problem(s)")
    return status


def main(argv: list[str] | None = None) -> int:
    """The command line: fetch into --dest (default .whl), or --check offline."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=Path(".whl"), help="the wheel folder (default .whl)")
    ap.add_argument("--check", action="store_true", help="offline: compare the plan with DEST/manifest.json")
    args = ap.parse_args(argv)
    dest: Path = args.dest
    if args.check:
        return check(dest)
    start = time.monotonic()
    added = fetch(dest)
    prune(dest)
    errors, trusted = plan.walk(plan.read_machine_packages(), dest)
    data = manifest(dest, trusted)
    errors += [f"{w['file']} does not install on cp312 manylinux x86_64 ({plan.PLATFORMS})"
               for w in data["wheels"] if not plan.installable(Path(w["file"]).name)]
    errors += size_errors(data)
    if errors:
        return report(errors, trusted)
    manifest_file = dest / "manifest.json"
    text = json.dumps(data, indent=1) + "\n"
    if not manifest_file.exists() or manifest_file.read_text() != text:
        manifest_file.write_text(text)  # only on a change: a second run leaves DEST untouched
    for w in data["wheels"]:
        log(f"{w['group']:<10} {w['file']:<72} {w['size'] / 2**20:6.2f} MiB")
    report([], trusted)
    done = f"added {added} wheel(s)" if added else "all wheels already present; nothing downloaded"
    log(f"{done}; {len(data['wheels'])} wheels, {data['total_bytes'] / 2**20:.1f} MiB, "
        f"{time.monotonic() - start:.1f} s")
    log("install: " + plan.install_line("/tmp/zt-site", f"{dest}/*.whl"))
    log("install: " + plan.install_line("/tmp/zt-ds-site", f"{dest}/deepspeed/*.whl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
