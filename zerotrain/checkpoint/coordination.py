"""Coordinator: the few collectives a checkpoint needs, on a Gloo group, with a timeout.

Checkpoint calls must be made by every rank. A barrier that waits forever would
turn a call from one rank alone into a hang, so ranks meet with
`monitored_barrier`, which fails after a timeout and names the absent ranks.
A dedicated Gloo group keeps this working when training runs on NCCL.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from zerotrain.checkpoint.errors import CheckpointError

# Seconds ranks wait for each other inside save/load; override for very slow file systems.
TIMEOUT_ENV = "ZEROTRAIN_CHECKPOINT_TIMEOUT"


class Coordinator:
    """Barrier / broadcast / gather among the ranks of one engine."""

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 300)))

    @classmethod
    def for_engine(cls, engine) -> "Coordinator":
        """Coordinates on the Gloo group the engine created for checkpoints."""
        return cls(engine._checkpoint_group, engine.rank, engine.world_size)

    def meet(self, what: str) -> None:
        if self.world_size == 1:
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"{what}: not every rank took part within {self.timeout.total_seconds():.0f}s — it must be "
                f"called on all {self.world_size} ranks ({e})"
            ) from e

    def from_rank0(self, value):
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_to_rank0(self, value) -> list:
        if self.world_size == 1:
            return [value]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.group)
        return out or []
