"""Named fault points: a test makes a process fail at a chosen moment, not after a lucky sleep.

The one way a fault is injected into zerotrain (no other test hooks in product code):

    ZEROTRAIN_FAULT=POINT:VICTIM[:N[:ACTION]]

    POINT   where: one of POINTS below.
    VICTIM  rankK (that rank only), all (every rank), launcher (rank 0 acts on the process that
            started the ranks, then carries on: the ranks must notice their parent is gone). A
            process with no RANK in its environment is rank 0: `consolidate:rank0` or
            `consolidate:all` act on a `zerotrain consolidate` (`launcher` would kill its shell).
    N       when: the N-th time (default 1) the victim reaches POINT. A numbered point (NUMBERED)
            carries a number of its own, and N is that number: `after_step:all:10` after step 10,
            `trial:rank1:2:oom` in the trial printed as "trial 2/…", `verify:rank1:0:oom` when
            verifying ZeRO stage 0 (numbered points fire every time they carry N).
    ACTION  what: kill (SIGKILL, the default), stop (SIGSTOP: a hang to be found, or a pause that a
            test holds for as long as it needs and then kills), oom (raise torch.OutOfMemoryError),
            fail (raise ValueError with a two-line message). The launcher takes kill or stop only.

Unset, a point costs one environment lookup. `tests/faults/`, `make soak`, and the tests of
`zerotrain train`'s resume, `tune` and `plan --verify` use them.
"""

from __future__ import annotations

import os
import signal
from typing import NamedTuple

FAULT_ENV = "ZEROTRAIN_FAULT"
POINTS = {
    "forward": "the engine's forward",
    "backward": "the engine's backward",
    "optimizer_step": "the engine's step",
    "shard_write": "a save: this rank's shard file is on disk, its RNG file and the rest of the save are not",
    "after_shards": "a save: this rank's files are written, rank 0 has not yet heard from the ranks",
    "before_rename": "a save (rank 0): meta.json and state.pt written, the temporary folder not yet renamed to TAG",
    "before_latest": "a save (rank 0): the tag is complete and in place, `latest` not yet moved",
    "nvme_write": "an optimizer-state swap to NVMe, part of the file written",
    "consolidate": "the first output file written into the staging folder, the others not: `zerotrain "
                   "consolidate`, zero_to_fp32, the Hugging Face export",
    "after_step": "`zerotrain train` finished a step (and saved, if one was due); numbered by the step",
    "trial": "each micro-step of a `zerotrain tune` trial; numbered by the trial, from 1 as printed",
    "verify": "a `zerotrain plan --verify` rank, before it builds the model; numbered by the ZeRO stage",
}
NUMBERED = ("after_step", "trial", "verify")
"""Points that carry a number of their own (the step, the trial, the stage), which N names."""
VICTIMS = ("all", "launcher")  # and rank0, rank1, ...
ACTIONS = ("kill", "stop", "oom", "fail")


class Fault(NamedTuple):
    """One parsed ZEROTRAIN_FAULT value."""

    point: str
    victim: str
    n: int
    action: str


_arrivals: dict[str, int] = {}


def parse_fault(spec: str) -> Fault:
    """The fault a ZEROTRAIN_FAULT value asks for; ValueError naming what is wrong and what is allowed."""
    parts = spec.split(":")
    if len(parts) not in (2, 3, 4):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected POINT:VICTIM[:N[:ACTION]]")
    point, victim = parts[0], parts[1]
    action = parts[3] if len(parts) == 4 else "kill"
    if point not in POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point {point!r}; points: {', '.join(POINTS)}")
    if victim not in VICTIMS and not (victim.startswith("rank") and victim[4:].isdigit()):
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown victim {victim!r}; victims: rankK, all, launcher")
    if action not in ACTIONS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown action {action!r}; actions: {', '.join(ACTIONS)}")
    if victim == "launcher" and action not in ("kill", "stop"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: the launcher can only be killed or stopped (kill, stop)")
    if len(parts) >= 3 and not parts[2].isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: N must be a whole number, not {parts[2]!r}")
    n = int(parts[2]) if len(parts) >= 3 else 1
    if n < 1 and point not in NUMBERED:
        raise ValueError(f"{FAULT_ENV}={spec!r}: N counts arrivals at {point} from 1")
    return Fault(point, victim, n, action)


def fault_point(name: str, number: int | None = None) -> None:
    """Where a test may make this process fail: does nothing unless ZEROTRAIN_FAULT names `name`.
    A NUMBERED point passes its `number` (the step, the trial, the stage); others count arrivals."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or not spec.startswith(name + ":"):
        return
    fault = parse_fault(spec)
    if number is None:
        _arrivals[name] = _arrivals.get(name, 0) + 1
        number = _arrivals[name]
    if number != fault.n:
        return
    rank = os.environ.get("RANK", "0")
    if fault.victim == "launcher":
        if rank == "0":
            os.kill(os.getppid(), signal.SIGSTOP if fault.action == "stop" else signal.SIGKILL)
    elif fault.victim in ("all", f"rank{rank}"):
        _act(fault, spec)


def _act(fault: Fault, spec: str) -> None:
    if fault.action in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGSTOP if fault.action == "stop" else signal.SIGKILL)
    elif fault.action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"out of memory (injected by a test: {FAULT_ENV}={spec})")
    else:
        # Two lines: callers that show an error's first line only are tested against the second.
        raise ValueError(f"injected failure (by a test) at {fault.point} ({FAULT_ENV}={spec})\n"
                         "second line of the message, which a one-line report leaves out")
