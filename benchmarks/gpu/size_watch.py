"""Run one trial process under watch: a wall-clock limit and a host-memory limit, killed cleanly past either.

Why not RLIMIT_AS: CUDA reserves huge virtual ranges, so an address-space cap kills every
CUDA process. Why not a cgroup: none may be writable on the GPU machine. Instead the watcher
polls (every 50 ms) the machine's MemAvailable and the trial's resident set, and SIGKILLs the
trial's whole process group when
- MemAvailable falls under `floor_bytes` (the machine is about to swap or to wake the kernel's
  OOM killer, which might pick another process): "host memory exceeded";
- the trial's RSS grows more than `rss_limit_bytes` over the baseline it reports after its
  imports (dry mode's fake host limit): "host memory exceeded";
- `timeout_s` passes: "timeout".
The trial is also made the OOM killer's first choice (oom_score_adj 1000), so that if memory
runs out between two polls, the kernel kills the trial, not the driver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.05


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (a trial may start helper processes)."""
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue  # it exited meanwhile
    return total


@dataclass
class Watched:
    """How a watched process ended, and the memory it took."""

    returncode: int | None
    killed: str | None  # "host memory exceeded: ...", "timeout", or None when it ended by itself
    wall_s: float
    peak_rss_bytes: int = 0
    peak_host_used_bytes: int = 0  # the machine's MemTotal - MemAvailable over its value at the start
    baseline_rss_bytes: int | None = None


def wait_for_memory(target_available: int, limit_s: float = 20.0) -> int:
    """Waits until MemAvailable is back near `target_available` (a killed trial's pinned pages take a
    moment to be unpinned and freed); returns MemAvailable then."""
    deadline = time.monotonic() + limit_s
    available = meminfo()["MemAvailable"]
    while available < target_available and time.monotonic() < deadline:
        time.sleep(0.25)
        available = meminfo()["MemAvailable"]
    return available


def run_watched(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float, floor_bytes: int,
                rss_limit_bytes: int | None = None, baseline_file: Path | None = None) -> Watched:
    """Runs `cmd` (output to `log_path`) until it exits or a limit is passed; see the module docstring."""
    start_used = _used()
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        Path(f"/proc/{proc.pid}/oom_score_adj").write_text("1000")
    except OSError:
        pass
    out = Watched(None, None, 0.0)
    while True:
        rc = proc.poll()
        if rc is not None:
            out.returncode = rc
            break
        info = meminfo()
        out.peak_host_used_bytes = max(out.peak_host_used_bytes, info["MemTotal"] - info["MemAvailable"] - start_used)
        rss = _tree_rss(proc.pid)
        out.peak_rss_bytes = max(out.peak_rss_bytes, rss)
        if out.baseline_rss_bytes is None and baseline_file is not None and baseline_file.exists():
            try:
                out.baseline_rss_bytes = int(baseline_file.read_text())
            except ValueError:
                pass  # written but not yet flushed; next poll
        if info["MemAvailable"] < floor_bytes:
            out.killed = (f"host memory exceeded: MemAvailable {info['MemAvailable'] / 2**30:.1f} GiB "
                          f"< floor {floor_bytes / 2**30:.1f} GiB")
        elif rss_limit_bytes is not None and out.baseline_rss_bytes is not None \
                and rss - out.baseline_rss_bytes > rss_limit_bytes:
            out.killed = (f"host memory exceeded: RSS grew {(rss - out.baseline_rss_bytes) / 2**20:.0f} MiB "
                          f"> limit {rss_limit_bytes / 2**20:.0f} MiB")
        elif time.monotonic() - t0 > timeout_s:
            out.killed = f"timeout ({timeout_s:g} s)"
        if out.killed:
            _kill_group(proc)
            out.returncode = proc.returncode
            break
        time.sleep(POLL_S)
    _kill_group(proc)  # anything the trial left behind in its session
    out.wall_s = time.monotonic() - t0
    return out


def _used() -> int:
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass  # stuck in the kernel (unpinning memory); it goes on its own
