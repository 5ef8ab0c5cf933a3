"""What the engine does for `sequence_parallel_size: N` > 1: build the groups, wrap the attention."""

from __future__ import annotations

from torch import nn

from zerotrain.sequence.attention import SequenceParallelError, install_ulysses_attention, runs_unsplit_in_eval
from zerotrain.sequence.groups import SequenceParallelGroups, initialize_sequence_parallel


def enable_sequence_parallel(model: nn.Module, sequence_parallel_size: int) -> SequenceParallelGroups:
    """Builds (or reuses) the layout of N consecutive ranks and makes `model`'s attention run on
    head shards over its group. Raises a user error for a model that cannot split (eager
    attention, head counts N does not fit) before any training step."""
    groups = initialize_sequence_parallel(sequence_parallel_size)
    install_ulysses_attention(model, groups.sequence_group)
    return groups


def require_global_positions(model: nn.Module, forward_kwargs: dict) -> None:
    """Refuses a sequence-parallel forward without `position_ids`: the model would number each
    rank's slice from 0, which the gathered positions would read as packed documents (silently
    wrong attention and rotary embeddings). An eval-mode forward passes when the attention was
    installed with `disable_in_eval` (DeepSpeed's flag): it then runs unsplit, on the batch as given."""
    if "position_ids" in forward_kwargs or (not model.training and runs_unsplit_in_eval(model)):
        return
    raise SequenceParallelError(
        "with sequence_parallel_size > 1 every forward needs position_ids=, the global positions of this "
        "rank's slice of the sequence: feed the batch through zerotrain.sequence.shard_batch (it adds them); "
        "to evaluate on whole sequences, register the attention with disable_in_eval=True and call eval()"
    )
