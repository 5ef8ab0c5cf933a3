"""Sequence-parallel groups: the world split into groups of N consecutive ranks (DeepSpeed's layout).

Ranks 0..N-1 share one sequence (each holds a 1/N slice of it), ranks N..2N-1 the next, and so
on. The ranks that hold the same slice position in different groups form a data-parallel group
(ranks r, r+N, r+2N, ...). ZeRO keeps sharding over every rank: gradients are averaged over the
whole world, which `sequence/loss.py` accounts for. The accessors carry DeepSpeed's mpu names
(`deepspeed/runtime/sequence_parallel/parallel_state_sp.py`) so Accelerate can call them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zerotrain.comm.teardown import OwnedGroup, own_group
from zerotrain.config.auto import sequence_groups_count
from zerotrain.sequence.gloo_all_to_all_fix import fix_gloo_all_to_all


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in a sequence-parallel layout of `size` consecutive ranks per group."""

    size: int
    """Ranks that share one sequence (N)."""
    rank: int
    """This rank's slice position within its sequence group (0..N-1)."""
    data_parallel_size: int
    """Number of sequence groups: world size / N."""
    data_parallel_rank: int
    """Which sequence group this rank is in: which samples of the global batch it trains on."""
    _sequence: OwnedGroup
    _data: OwnedGroup

    @property
    def sequence_group(self):
        """The process group of this rank's N consecutive ranks (None when N is 1)."""
        return self._sequence.group

    @property
    def data_group(self):
        """The ranks at this rank's slice position in every sequence group (None when only one)."""
        return self._data.group


_built: dict[int, SequenceParallelGroups] = {}
_current: SequenceParallelGroups | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceParallelGroups:
    """Builds (once per size; a collective on every rank) and selects the groups for N = size.

    Every rank must call it with the same size, as with any `new_group`.
    """
    global _current
    world, rank = dist.get_world_size(), dist.get_rank()
    sequence_groups_count(sequence_parallel_size, world)  # a ConfigError unless N divides the world
    if sequence_parallel_size not in _built:
        n = sequence_parallel_size
        sequence = data = None
        # new_group is collective over the world: every rank creates every group, in one order.
        for first in range(0, world, n):
            group = dist.new_group(list(range(first, first + n))) if n > 1 else None
            sequence = group if first <= rank < first + n else sequence
        for position in range(n):
            members = list(range(position, world, n))
            group = dist.new_group(members) if len(members) > 1 else None
            data = group if rank % n == position else data
        _built[n] = SequenceParallelGroups(n, rank % n, world // n, rank // n, own_group(sequence), own_group(data))
        if n > 1 and dist.get_backend() == dist.Backend.GLOO:
            fix_gloo_all_to_all()  # the Ulysses loss's autograd all_gather backward, on groups without rank 0
    _current = _built[sequence_parallel_size]
    return _current


def current_groups() -> SequenceParallelGroups:
    """The layout selected last by `initialize_sequence_parallel`; an error before that."""
    if _current is None:
        raise RuntimeError(
            "sequence parallelism is not initialized: set sequence_parallel_size in the config "
            "(the engine builds the groups) or call initialize_sequence_parallel(N) on every rank"
        )
    return _current


def is_initialized() -> bool:
    """Whether a sequence-parallel layout has been selected in this process."""
    return _current is not None


# DeepSpeed's mpu accessors (parallel_state_sp.py), over the selected layout.


def get_sequence_parallel_group():
    """The process group of the ranks sharing this rank's sequence."""
    return current_groups().sequence_group


def get_sequence_parallel_world_size() -> int:
    """N: ranks per sequence."""
    return current_groups().size


def get_sequence_parallel_rank() -> int:
    """This rank's slice position in its sequence (0..N-1)."""
    return current_groups().rank


def get_sequence_data_parallel_group():
    """DeepSpeed's sequence-data-parallel group: every rank (N x data-parallel size = the world)."""
    current_groups()
    return dist.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    """The world size: the ranks ZeRO shards over and averages gradients over."""
    current_groups()
    return dist.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    """This rank in the world."""
    current_groups()
    return dist.get_rank()


def get_data_parallel_group():
    """The ranks at this rank's slice position in every sequence group."""
    return current_groups().data_group


def get_data_parallel_world_size() -> int:
    """Number of sequence groups (samples trained side by side)."""
    return current_groups().data_parallel_size


def get_data_parallel_rank() -> int:
    """Which sequence group this rank belongs to."""
    return current_groups().data_parallel_rank


get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
