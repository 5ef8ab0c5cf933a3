"""Destroying the process groups zerotrain created while the interpreter is still whole.

Why this exists: DeepSpeed-style scripts end without `destroy_process_group()`.
Python then destroys the groups during interpreter finalization. Gloo runs every
collective on C++ worker threads, and a finished work object there can still hold
tensors that have Python objects. When such a thread drops its last reference
during finalization it must take the GIL, which is gone: the thread is torn down
from under a C++ destructor and the process dies with "terminate called without
an active exception" (SIGABRT) or a segfault: 5 of 30 runs of a 2-rank stage-1
CPU-offload script before this hook, 0 of 30 after. An atexit hook runs before finalization, so destroying the groups there
joins those threads while Python objects can still be released.

After an unhandled error the groups are left alone: peers may be blocked in a
collective with this rank, and tearing down then can hang (NCCL) instead of
exiting. `sys.last_value` is Python's own record of an unhandled error (the
launcher's bootstrap sets it too when it reports one).
"""

from __future__ import annotations

import atexit
import glob
import sys
import time

import torch.distributed as dist

# Gloo's collective threads, by the name torch gives them.
_GLOO_WORKER_NAME = "pt_gloo_runloop"


class OwnedGroup:
    """A subgroup zerotrain created, held here so teardown can drop the last reference.

    Gloo joins its worker threads only in the group's C++ destructor (its `shutdown()`
    does not), and torch runs that destructor with the GIL released. So the group must
    lose its last Python reference inside the atexit hook, not at finalization: code
    keeps this handle, never the group itself.
    """

    def __init__(self, group) -> None:
        self.group = group


_owned: list[OwnedGroup] = []
_default_group_ours = False
_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(destroy_process_groups)
        _registered = True


def destroy_default_group_at_exit() -> None:
    """Call right after zerotrain itself initialized the default process group."""
    global _default_group_ours
    _default_group_ours = True
    _register()


def own_group(group) -> OwnedGroup:
    """Wraps a subgroup zerotrain created (e.g. the checkpoint group) so it is destroyed at exit."""
    handle = OwnedGroup(group)
    if group is not None:
        _owned.append(handle)
        _register()
    return handle


def destroy_process_groups() -> None:
    """Destroys zerotrain's groups (all of them when zerotrain owns the default group).

    Idempotent, and a no-op when the process is ending on an unhandled error. Safe
    after the user's own `destroy_process_group()`.
    """
    global _default_group_ours
    if getattr(sys, "last_value", None) is not None or not dist.is_available():
        return
    while _owned:
        handle = _owned.pop()
        if dist.is_initialized() and not _default_group_ours:
            try:
                dist.destroy_process_group(handle.group)  # the user owns the default group
            except (ValueError, RuntimeError):
                pass  # already destroyed along with the user's groups
        handle.group = None  # the last reference: the destructor joins Gloo's threads now
    if _default_group_ours and dist.is_initialized():
        dist.destroy_process_group()  # every group, the default last
    _default_group_ours = False
    wait_for_idle_gloo_workers()


def _gloo_worker_states() -> list[str]:
    """The scheduler state (R, S, D, ...) of each Gloo collective thread of this process (Linux)."""
    states = []
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if not f.read().startswith(_GLOO_WORKER_NAME):
                    continue
            with open(f"{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread exited meanwhile
    return states


def wait_for_idle_gloo_workers(timeout_s: float = 2.0, poll_s: float = 0.005) -> bool:
    """Sleeps (GIL released) until every Gloo worker thread is asleep in two polls running.

    A worker that just finished a collective still has to release the work object,
    which needs the GIL; it may be waiting for it or not yet scheduled. Sleeping
    hands the GIL over, so a worker still asleep two polls later is waiting for
    work, not for Python, and finalization can no longer catch it half way.
    Returns False if the workers were still busy at `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    quiet_polls = 0
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        states = _gloo_worker_states()
        quiet_polls = quiet_polls + 1 if all(state in "SI" for state in states) else 0
        if quiet_polls >= 2:
            return True
    return False
