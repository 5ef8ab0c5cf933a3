"""Finding and signalling the processes of one job on this node, by the job id they carry.

Every process a node agent starts inherits JOB_ID_ENV and NODE_RANK_ENV, so the
agent can end exactly its own job's processes, even ones its children left
behind, without touching another job started from the same script.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable


def _environ_of(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def job_processes(job_id: str, node_rank: int | None = None, *, exclude: Iterable[int] = ()) -> list[int]:
    """Pids of live processes carrying this job id (and node rank, when given), minus `exclude`."""
    from zerotrain.launcher.node_job import JOB_ID_ENV, NODE_RANK_ENV

    wanted = [f"{JOB_ID_ENV}={job_id}".encode()]
    if node_rank is not None:
        wanted.append(f"{NODE_RANK_ENV}={node_rank}".encode())
    skip = {os.getpid(), *exclude}
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        variables = _environ_of(int(name)).split(b"\0")
        if all(item in variables for item in wanted):
            found.append(int(name))
    return found


def signal_processes(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_processes(pids: Iterable[int]) -> None:
    """SIGTERM, then SIGCONT: a process stopped by SIGSTOP or Ctrl-Z acts on its SIGTERM only once
    continued (shells and systemd do the same); without it, it waits out any grace and is killed."""
    pids = list(pids)
    signal_processes(pids, signal.SIGTERM)
    signal_processes(pids, signal.SIGCONT)


def kill_job_processes(job_id: str, node_rank: int | None, *, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process of the job on this node, SIGKILL what is left after `grace_s`; returns the pids found."""
    pids = job_processes(job_id, node_rank)
    terminate_processes(pids)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        alive = job_processes(job_id, node_rank)
        if not alive:
            return pids
        time.sleep(0.1)
    signal_processes(job_processes(job_id, node_rank), signal.SIGKILL)
    return pids
