"""Ulysses sequence parallelism: each of N consecutive ranks holds 1/N of every sequence.

`groups.py` builds the layout and DeepSpeed's mpu accessors, `batch_shard.py` cuts a rank's
slice of a batch, `attention.py` runs a transformers model's attention on head shards between
two all-to-alls (`all_to_all.py`), and `loss.py` makes the group's loss the token-weighted mean
over the whole sequence with sp = 1's gradient scale. The engine builds the groups and installs
the attention when the config sets `sequence_parallel_size` > 1.
"""

from zerotrain.sequence.attention import (
    SequenceParallelError,
    UlyssesAttention,
    install_ulysses_attention,
    uninstall_ulysses_attention,
)
from zerotrain.sequence.batch_shard import shard_batch, shift_labels
from zerotrain.sequence.groups import (
    SequenceParallelGroups,
    current_groups,
    initialize_sequence_parallel,
)
from zerotrain.sequence.loss import sequence_parallel_loss

__all__ = [
    "SequenceParallelError",
    "SequenceParallelGroups",
    "UlyssesAttention",
    "current_groups",
    "initialize_sequence_parallel",
    "install_ulysses_attention",
    "sequence_parallel_loss",
    "shard_batch",
    "shift_labels",
    "uninstall_ulysses_attention",
]
