"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the mpu of Ulysses, over zerotrain's
groups of N consecutive ranks (zerotrain/sequence/groups.py)."""

from zerotrain.sequence.groups import (  # noqa: F401
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
)
from zerotrain.sequence.groups import initialize_sequence_parallel as _initialize


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Builds the groups of `sequence_parallel_size` consecutive ranks (every rank must call it)."""
    _initialize(sequence_parallel_size)
