"""What the DeepSpeed config changes in the model itself, applied in one place when the engine is built.

Before the engine plans its buckets and stage-3 units: ZeRO-3 leaf modules
(`zero_optimization.leaf_module`), activation-checkpoint offload to the CPU
(`activation_checkpointing.cpu_checkpointing`, on the layers the model already checkpoints, as the HF
Trainer and Accelerate enable it before `deepspeed.initialize`), and Ulysses sequence parallelism
(`sequence_parallel_size`).
"""

from __future__ import annotations

from torch import nn

from zerotrain.config import ZeroTrainConfig
from zerotrain.runtime.activation_offload import enable_activation_offload
from zerotrain.sequence.enable import enable_sequence_parallel
from zerotrain.sequence.groups import SequenceParallelGroups
from zerotrain.zero.leaf_modules import apply_leaf_module_config


def apply_model_options(model: nn.Module, config: ZeroTrainConfig) -> SequenceParallelGroups | None:
    """Applies the config's model options to `model` in place; returns the sequence-parallel groups
    (None without sequence parallelism). User errors (a leaf name that matches nothing, offload with no
    checkpointed layer, a model that cannot split its heads) come before any training step."""
    apply_leaf_module_config(model, config.zero_optimization)  # ZeRO-3: before its units are chosen
    if config.activation_checkpointing.cpu_checkpointing:
        enable_activation_offload(model, setting="activation_checkpointing.cpu_checkpointing")
    sp = config.sequence_parallel_size  # Ulysses: N consecutive ranks share each sequence
    return enable_sequence_parallel(model, sp) if sp > 1 else None
