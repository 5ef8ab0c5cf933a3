"""Named fault points: a crash test kills a process at a chosen moment, not after a lucky sleep.

`ZEROTRAIN_FAULT=POINT:VICTIM[:N[:stop]]` kills VICTIM with SIGKILL the N-th time (default 1) a
rank reaches POINT (with `stop`: freezes it with SIGSTOP instead, a hang to be found):

    POINT   forward, backward, optimizer_step (the engine's calls); shard_write (a rank's shard
            is on disk, the rest of the save is not), before_latest (the tag is complete and in
            place, `latest` not yet moved); nvme_write (an optimizer-state swap to NVMe);
            consolidate (the first output file written into the staging folder, the others not:
            `zerotrain consolidate`, zero_to_fp32, the Hugging Face export)
    VICTIM  rankK (that rank only), all (every rank, each at its own N-th arrival), launcher
            (rank 0 kills the process that started the ranks, then carries on: the ranks must
            notice that their parent is gone and stop). A process with no RANK in its
            environment is rank 0: `consolidate:rank0` or `consolidate:all` kill a
            `zerotrain consolidate` (`launcher` would kill the shell that started it).

Unset, a point costs one environment lookup. `tests/faults/` and `make soak` use them.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "ZEROTRAIN_FAULT"
POINTS = ("forward", "backward", "optimizer_step", "shard_write", "before_latest", "nvme_write", "consolidate")
VICTIMS = ("all", "launcher")  # and rank0, rank1, ...

_arrivals: dict[str, int] = {}


def parse_fault(spec: str) -> tuple[str, str, int, str]:
    """(point, victim, n, action) of a ZEROTRAIN_FAULT value; ValueError naming what is wrong."""
    parts = spec.split(":")
    if len(parts) not in (2, 3, 4) or (len(parts) == 4 and parts[3] not in ("kill", "stop")):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected POINT:VICTIM[:N[:stop]]")
    point, victim = parts[0], parts[1]
    if point not in POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point {point!r}; points: {', '.join(POINTS)}")
    if victim not in VICTIMS and not (victim.startswith("rank") and victim[4:].isdigit()):
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown victim {victim!r}; victims: rankK, all, launcher")
    n = int(parts[2]) if len(parts) >= 3 else 1
    if n < 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: N counts arrivals from 1")
    return point, victim, n, parts[3] if len(parts) == 4 else "kill"


def fault_point(name: str) -> None:
    """Where a test may kill a process: does nothing unless ZEROTRAIN_FAULT names `name`."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or not spec.startswith(name + ":"):
        return
    point, victim, n, action = parse_fault(spec)
    _arrivals[point] = _arrivals.get(point, 0) + 1
    if _arrivals[point] != n:
        return
    rank = os.environ.get("RANK", "0")
    if victim == "all" or victim == f"rank{rank}":
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
    elif victim == "launcher" and rank == "0":
        os.kill(os.getppid(), signal.SIGKILL)
