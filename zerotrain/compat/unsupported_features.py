"""What zerotrain does not have, refused with an error that says so and what to do instead."""

from __future__ import annotations


class NotSupportedByZerotrain(NotImplementedError):
    """A DeepSpeed feature zerotrain does not implement."""


def _refuse(feature: str, instead: str) -> NotSupportedByZerotrain:
    return NotSupportedByZerotrain(
        f"{feature} is not supported by zerotrain (the `deepspeed` package here is zerotrain's stand-in). "
        f"{instead} See docs/huggingface.md, 'What is not supported'."
    )


def tp_model_init(*args, **kwargs):
    """DeepSpeed's AutoTP entry point: zerotrain has no tensor parallelism."""
    raise _refuse(
        "Tensor parallelism (tensor_parallel.autotp_size > 1)",
        "Remove the tensor_parallel section; ZeRO stage 3 shards the parameters instead.",
    )


def model_parallel_unsupported(*args, **kwargs):
    """An mpu for Megatron-style model (tensor or pipeline) parallelism passed to initialize()."""
    raise _refuse(
        "Model parallelism from an mpu (Megatron-style tensor/pipeline groups)",
        "Pass no mpu, or the sequence-parallel mpu of UlyssesSPAttentionHF.register_with_transformers.",
    )
