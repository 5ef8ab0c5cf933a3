"""Launch one trial in a watched child process and turn how it ended into the trial's record.

The child is size_trial.py (a world of one); size_watch.py kills it past the host-memory limit
or the timeout. The record holds the child's measurements, or the reason it failed: "host
memory", "CUDA OOM", "timeout", "budget" (a timeout that was the budget's, not the trial's
limit) or "error".
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from size_ladder import Size
from size_search import Search
from size_watch import run_watched

TRIAL = Path(__file__).resolve().parent / "size_trial.py"
LOG_KEEP_BYTES = 16_384  # per trial log: the tail, where a failure's traceback is


@dataclass
class Limits:
    """What a trial may use, and how the driver measures host memory."""

    floor_bytes: int  # kill when the machine's MemAvailable drops under this
    host_limit_bytes: int  # the host memory a trial may take (for extrapolation and the report)
    rss_limit_bytes: int | None  # dry mode: kill past this RSS growth (the fake host limit)
    trial_timeout_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_env(cuda: bool, threads: int) -> dict[str, str]:
    """A world of one, the same threads for both engines, and DeepSpeed on the right accelerator."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if not cuda:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def run_trial(search: Search, size: Size, *, python: str, cuda: bool, threads: int, seq: int, steps: int,
              stage3_build: str, limits: Limits, timeout_s: float, log_dir: Path, budget_cut: bool) -> dict[str, Any]:
    """Runs one trial in a watched child process; returns its record (see size.py's JSON)."""
    stem = f"{search.mode}.{search.engine}.{size.name}"
    out, log = log_dir / f"{stem}.json", log_dir / f"{stem}.log"
    for stale in (out, Path(str(out) + ".baseline")):
        stale.unlink(missing_ok=True)
    cmd = [python, str(TRIAL), "--engine", search.engine, "--mode", search.mode, "--size",
           json.dumps(size.as_dict()), "--seq", str(seq), "--steps", str(steps),
           "--device", "cuda" if cuda else "cpu", "--stage3-build", stage3_build, "--out", str(out)]
    watched = run_watched(cmd, trial_env(cuda, threads), log, timeout_s, limits.floor_bytes,
                          limits.rss_limit_bytes, Path(str(out) + ".baseline"))
    _trim_log(log)
    Path(str(out) + ".baseline").unlink(missing_ok=True)
    child = json.loads(out.read_text()) if out.exists() else {}
    baseline = child.get("baseline_rss_bytes") or watched.baseline_rss_bytes
    rss_peak = max(child.get("host_peak_rss_bytes") or 0, watched.peak_rss_bytes)
    record: dict[str, Any] = {
        "mode": search.mode, "engine": search.engine, "size": size.name, "index": size.index,
        "params": size.params, "layers": size.layers, "wall_s": round(watched.wall_s, 2),
        "host_rss_peak_bytes": rss_peak, "host_rss_baseline_bytes": baseline,
        "host_used_peak_bytes": watched.peak_host_used_bytes,
        # The host memory a trial took: on a GPU the machine's used memory over its value at the start
        # (pinned buffers included, whatever RSS shows of them); dry, the trial's own RSS growth.
        "host_peak_bytes": watched.peak_host_used_bytes if cuda else max(0, rss_peak - (baseline or rss_peak)),
        "log": str(log),
    }
    for key in ("tokens_per_s", "step_s", "losses", "build_s", "gpu_peak_bytes", "gpu_peak_reserved_bytes",
                "gpu_build_peak_bytes", "phase", "error"):
        if key in child:
            record[key] = child[key]
    finished = child.get("status") == "ok"
    if watched.killed and watched.killed.startswith("timeout") and finished:
        # Its steps were done and written; only the exit was cut (unpinning ~100 GiB takes seconds:
        # the 7B trial of 2026-11-26 wrote its result at 173 s and was still exiting at 189 s).
        record.update(status="ok", reason=None, detail=f"result written; killed while exiting ({watched.killed})")
    elif watched.killed:
        cut = budget_cut and watched.killed.startswith("timeout")
        reason = "budget" if cut else ("host memory" if watched.killed.startswith("host memory") else "timeout")
        record.update(status="failed", reason=reason, detail=watched.killed)
    elif finished:
        record.update(status="ok", reason=None)
        if limits.rss_limit_bytes is not None and record["host_peak_bytes"] > limits.rss_limit_bytes:
            # Dry mode: a peak between two polls of the watcher, seen afterwards in VmHWM.
            record.update(status="failed", reason="host memory",
                          detail=f"host memory exceeded: RSS grew {record['host_peak_bytes'] / 2**20:.0f} MiB "
                                 f"> limit {limits.rss_limit_bytes / 2**20:.0f} MiB (VmHWM)")
    elif child:
        record.update(status="failed", reason=child.get("reason", "error"), detail=child.get("error", ""))
    else:
        signal = -watched.returncode if watched.returncode and watched.returncode < 0 else None
        why = "host memory" if signal == 9 else "error"  # SIGKILL not ours: the kernel's OOM killer
        record.update(status="failed", reason=why, detail=f"exited {watched.returncode} without a result "
                      + ("(SIGKILL: the kernel's OOM killer)" if signal == 9 else f"; see {log}"))
    return record


def _trim_log(log: Path) -> None:
    """Keeps the tail of a trial's log: DeepSpeed's start-up banner is long, the traceback is at the end."""
    try:
        data = log.read_bytes()
    except OSError:
        return
    if len(data) > LOG_KEEP_BYTES:
        log.write_bytes(b"[... head cut ...]\n" + data[-LOG_KEEP_BYTES:])


def python_has(python: str, module: str) -> bool:
    """Whether `python` can import `module` (found, not imported: DeepSpeed's import is slow)."""
    if python == sys.executable:
        import importlib.util

        return importlib.util.find_spec(module) is not None
    import subprocess

    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], check=False, capture_output=True, timeout=60).returncode == 0
