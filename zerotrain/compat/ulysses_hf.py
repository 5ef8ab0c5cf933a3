"""DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` (0.19.8), on zerotrain/sequence.

What Accelerate (>= 1.12) calls when `ParallelismConfig(sp_backend="deepspeed", sp_size=N)`: build
the groups of N consecutive ranks, wrap the core attention kernel in transformers'
`ALL_ATTENTION_FUNCTIONS`, and return the mpu (DeepSpeed's `parallel_state_sp` accessors) that
`deepspeed.initialize(..., mpu=)` then takes the sequence-parallel size from.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger("zerotrain")


def register_with_transformers(
    model_name_or_path: Any,
    core_attn_implementation: str,
    sequence_parallel_size: int,
    micro_batch_size: int,
    seq_length: int | None = None,
    seq_length_is_variable: bool = True,
    disable_in_eval: bool = False,
    max_length: int | None = None,
) -> ModuleType | None:
    """Makes transformers' `core_attn_implementation` run Ulysses over groups of
    `sequence_parallel_size` consecutive ranks; returns the mpu module, or None when the size is 1.

    `model_name_or_path`: the model (its config is read) or a name/path for `AutoConfig`. A loaded
    model must use `core_attn_implementation`. `micro_batch_size`, `seq_length` and
    `seq_length_is_variable` are DeepSpeed's buffer-size hints: zerotrain sizes every exchange from
    the tensors themselves, so they are only checked. `disable_in_eval`: eval-mode forwards run
    unsplit. `max_length`: the deprecated name of `seq_length`.
    """
    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        logger.warning("register_with_transformers: `max_length` is deprecated, use `seq_length`")
        seq_length = seq_length if seq_length is not None else max_length
    if not seq_length_is_variable and seq_length is None:
        raise ValueError(
            "Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to an integer "
            "value of the fixed batch size length."
        )
    from transformers import AutoConfig

    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from zerotrain.sequence.attention import install_for_config

    loaded = hasattr(model_name_or_path, "config")
    config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
    if loaded:
        model_impl = getattr(config, "_attn_implementation", None)
        if model_impl is not None and model_impl != core_attn_implementation:
            raise ValueError(
                f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                f"attn_implementation='{model_impl}'. Set both to the same value so sequence-parallel wrapper can "
                "intercept the active attention path. (With Accelerate: DeepSpeedSequenceParallelConfig("
                f"sp_attn_implementation='{model_impl}'), or load the model with that attn_implementation.)"
            )
    if core_attn_implementation in ("eager", "paged|eager"):
        raise ValueError(
            f"{core_attn_implementation} attn_implementation isn't currently supported by Ulysses sequence "
            "parallelism: it materialises the full [seq x seq] attention matrix. Use 'sdpa' (or flash_attention_2/3 "
            "on a GPU)."
        )
    if seq_length is not None and seq_length % sequence_parallel_size:
        raise ValueError(f"seq_length {seq_length} is not divisible by sequence_parallel_size {sequence_parallel_size}")
    mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    install_for_config(config, core_attn_implementation, mpu.get_sequence_parallel_group(), disable_in_eval)
    return mpu
