"""`deepspeed.utils.groups`: the sequence-parallel accessors Accelerate and the Trainer read.

`mpu` is set by `deepspeed.initialize(..., mpu=)`, as DeepSpeed's engine does; without one, the
layout the engine built for `sequence_parallel_size` is used, and sp = 1 otherwise.
"""

import torch.distributed as dist

from zerotrain.sequence import groups as _sequence

mpu = None


def _layout():
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_group"):
        return mpu
    return _sequence if _sequence.is_initialized() else None


def _get_sequence_parallel_world_size() -> int:
    """Ranks per sequence (1 without sequence parallelism)."""
    layout = _layout()
    return layout.get_sequence_parallel_world_size() if layout else 1


def _get_sequence_parallel_rank() -> int:
    """This rank's slice position in its sequence (0 without sequence parallelism)."""
    layout = _layout()
    return layout.get_sequence_parallel_rank() if layout else 0


def _get_sequence_parallel_group():
    """The process group of the ranks sharing this rank's sequence."""
    layout = _layout()
    if layout is None:
        raise KeyError("No sequence parallel group found")
    return layout.get_sequence_parallel_group()


def _get_sequence_data_parallel_group():
    """Every rank (ZeRO shards and averages over the whole world)."""
    return dist.group.WORLD


def _get_sequence_data_parallel_world_size() -> int:
    """The world size."""
    return dist.get_world_size()


def _get_sequence_data_parallel_rank() -> int:
    """This rank in the world."""
    return dist.get_rank()


def _get_data_parallel_world_size() -> int:
    """Sequence groups side by side: world / sp."""
    return dist.get_world_size() // _get_sequence_parallel_world_size()


def _get_data_parallel_rank() -> int:
    """Which sequence group this rank belongs to."""
    return dist.get_rank() // _get_sequence_parallel_world_size()
