#!/usr/bin/env python
"""The GPU check's **correct** part: the test suite's one-GPU cases, with their results as a table.

    python benchmarks/gpu/correct.py --out-dir DIR [--dry] [-- PYTEST ARGS]

Runs pytest on the tests marked `cuda` (each is the one-GPU parameter of a test that CI runs on
the CPU: see `on_gpu` in tests/conftest.py), as a world of 1 over NCCL, and writes DIR/correct.json
(every test: outcome, seconds, message) and DIR/correct.md (passed / failed / skipped per area, then
each failure's first lines). Exit status: pytest's (0 when every selected case passed).

Dry mode (`--dry` or GPU_CHECK_DRY=1, the CI run of this script): the same cases on the CPU (Gloo,
world of 1), limited to DRY_SELECTION so that CI stays fast; the rest run in CI as their CPU cases.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# test module -> what it shows on the GPU (the table's rows, in this order)
AREAS = {
    "tests/zero/test_parity.py": "parity with one process: stages 0-3, fp32/bf16/fp16, CPU offload (pinned), NVMe offload",
    "tests/checkpoint/test_resume.py": "checkpoint save / resume (bitwise) / reshard CPU <-> GPU and across stages",
    "tests/train/test_train_job.py": "`zerotrain train` on the embedded default, 1 process",
    "tests/hf/test_trainer.py": "HF Trainer with DeepSpeed configs (stages 1-3, offload), 1 process",
    "tests/hf/test_accelerate.py": "Accelerate with DeepSpeed configs, 1 process",
    "tests/bench/test_comm.py": "`zerotrain bench comm` on one GPU",
}
DRY_SELECTION = ["tests/bench/test_comm.py"]
"""What a dry run executes: one case, seconds of CPU, enough to run this script end to end (pytest's
selection, the JUnit results, the table). The rest runs in CI as its CPU cases: parity's world of 1
would repeat, in a minute of CPU, the same stage/precision/offload cases its CPU worlds of 2 and 4 run."""


def _area(nodeid_or_file: str) -> str:
    path = nodeid_or_file.split("::")[0]
    return AREAS.get(path, path)


def run_pytest(out_dir: Path, dry: bool, extra: list[str]) -> tuple[int, Path, str]:
    """Runs the selection; returns (exit status, JUnit XML path, the command)."""
    junit = out_dir / "correct-junit.xml"
    targets = DRY_SELECTION if dry else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-v", "-rfE", "--durations=15",
           f"--junitxml={junit}", *targets, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry:
        env["GPU_CHECK_DRY"] = "1"
    print("[correct] " + " ".join(cmd[1:]), flush=True)
    code = subprocess.run(cmd, cwd=REPO, env=env).returncode
    return code, junit, " ".join(["python", *cmd[1:]]).replace(str(junit), "correct-junit.xml")


def read_junit(junit: Path) -> list[dict]:
    """One dict per test case: nodeid, area, outcome (passed/failed/error/skipped), seconds, message."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = classname.replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "") + "\n" + (node.text or "")
                break
        cases.append({"nodeid": f"{file}::{name}", "area": _area(file), "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "message": message.strip()[:4000]})
    return cases


def summarize(cases: list[dict]) -> list[dict]:
    """Per area, in AREAS order (unknown files after): counts and seconds."""
    order = list(AREAS.values())
    rows: dict[str, dict] = {}
    for c in cases:
        row = rows.setdefault(c["area"], {"area": c["area"], "passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
        row["failed" if c["outcome"] in ("failed", "error") else c["outcome"]] += 1
        row["seconds"] += c["seconds"]
    return sorted(rows.values(), key=lambda r: order.index(r["area"]) if r["area"] in order else len(order))


def markdown(meta: dict, rows: list[dict], cases: list[dict]) -> str:
    lines = [f"### Correctness on {meta['device']} ({meta['date']})", "",
             f"`{meta['command']}` — {meta['versions']}", "",
             "| area | passed | failed | skipped | seconds |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['area']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['seconds']:.0f} |" for r in rows]
    total = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped")}
    lines += [f"| **all** | {total['passed']} | {total['failed']} | {total['skipped']} | "
              f"{sum(r['seconds'] for r in rows):.0f} |", ""]
    failed = [c for c in cases if c["outcome"] in ("failed", "error")]
    if failed:
        lines += ["Failures:", ""]
        for c in failed:
            first = "; ".join(line.strip() for line in c["message"].splitlines()[:3] if line.strip())
            lines.append(f"- `{c['nodeid']}`: {first[:400]}")
        lines.append("")
    if not cases:
        lines += ["No test ran: see correct.log.", ""]
    return "\n".join(lines)


def describe_machine() -> tuple[str, str]:
    """(device name, versions line) without touching the GPU beyond a name query."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run: Gloo, no CUDA)"
    # transformers' version from its metadata: importing it only for the string costs seconds of CPU.
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = "not installed"
    versions = f"torch {torch.__version__}, transformers {transformers}, Python {sys.version.split()[0]}"
    return device, versions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "runs/gpu", help="where correct.json/.md go")
    p.add_argument("--dry", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="CPU run of the selection in DRY_SELECTION (default from GPU_CHECK_DRY=1)")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args(argv)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    code, junit, command = run_pytest(out, args.dry, args.pytest_args)
    cases = read_junit(junit) if junit.is_file() else []
    junit.unlink(missing_ok=True)  # its content is in correct.json; $OUT brings back few files
    rows = summarize(cases)
    device, versions = describe_machine()
    meta = {"device": device, "versions": versions, "dry": args.dry, "pytest_exit": code,
            "seconds": round(time.monotonic() - start, 1), "command": command,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    (out / "correct.json").write_text(json.dumps({"meta": meta, "areas": rows, "tests": cases}, indent=1))
    (out / "correct.md").write_text(markdown(meta, rows, cases))
    failed = sum(r["failed"] for r in rows)
    print(f"[correct] {sum(r['passed'] for r in rows)} passed, {failed} failed, "
          f"{sum(r['skipped'] for r in rows)} skipped in {meta['seconds']:.0f}s -> {out}/correct.md", flush=True)
    if code == 0 and not cases:
        return 1  # nothing selected is not a pass
    return code


if __name__ == "__main__":
    sys.exit(main())
