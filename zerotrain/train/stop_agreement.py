"""Every rank agrees to stop at the same step, without a collective that holds up the step.

A stop request (Ctrl-C, SIGTERM, the STOP file) may reach one rank only, and all ranks must leave
the loop after the same step, or the next collective hangs. Asking "did any rank see one?" with a
device all-reduce and `.item()` every step would stall the host on the GPU every step. Instead each
step starts a MAX all-reduce of the rank's flag on a CPU (Gloo) group, in the background, and reads
the one started a step earlier: it has long completed, so the read waits for nothing, and every rank
reads the same value at the same step. The price: a request is acted on one step later than it was
seen (with one rank, at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotrain.comm.teardown import own_group
from zerotrain.train.run_control import StopSignal


class StopAgreement:
    """`poll()` once per step on every rank: True on every rank at the same step once any asked to stop."""

    def __init__(self, signal: StopSignal, world_size: int) -> None:
        self.signal = signal
        # Creating a group is a collective: this object is built on every rank, at the same point.
        self._group = own_group(dist.new_group(backend="gloo")) if world_size > 1 else None
        # Two flags used in turn: the one in flight and the one being filled (no allocation per step).
        self._flags = [torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]
        self._turn = 0
        self._pending = None  # the work handle of the all-reduce started at the previous poll

    def poll(self) -> bool:
        """Whether the ranks agreed to stop after this step (a request seen at the previous poll)."""
        if self._group is None:
            return self.signal.requested_here()
        agreed = False
        if self._pending is not None:
            self._pending.wait()  # started a step ago: complete by now
            self._pending = None
            agreed = bool(self._flags[self._turn][0])  # a CPU tensor: nothing waits on a device
        if agreed:
            return True
        self._turn ^= 1
        flag = self._flags[self._turn]
        flag.fill_(1 if self.signal.requested_here() else 0)
        self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group.group, async_op=True)
        return False

    def close(self) -> None:
        """Lets a last all-reduce still in flight finish (the loop ended before its answer was read)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
