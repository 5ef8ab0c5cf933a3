"""The memory options a `zerotrain train` run trains with, as one of its opening lines.

Activation checkpointing, the chunked loss, offload and sequence parallelism change what a step
keeps in memory (and costs in time); they are set in three places (two `training` keys and the DeepSpeed section), so
the run says at its start which are on rather than leaving it to config.yaml.
"""

from __future__ import annotations

from typing import Any

CHECKPOINTING_MODES = {False: "none", True: "full", "selective": "selective"}


def describe_memory_options(checkpointing: bool | str, loss_chunk_tokens: int | None, zero_optimization: Any,
                            tiled_mlp: bool | int = False, offload_activations: bool = False,
                            sequence_parallel_size: int = 1) -> str:
    """One line naming activation checkpointing's mode (none / full / selective), the chunked loss's
    chunk (or off) and where optimizer state and parameters are offloaded (none / cpu / nvme), each
    with the key that sets it, then the tiled MLP, activation offload and sequence parallelism when on.
    `zero_optimization`: the engine's parsed zero_optimization section."""
    mode = CHECKPOINTING_MODES.get(checkpointing, str(checkpointing))
    chunk = f"{loss_chunk_tokens:,} tokens per chunk" if loss_chunk_tokens else "off"
    optimizer = _offload_device(getattr(zero_optimization, "offload_optimizer", None))
    params = _offload_device(getattr(zero_optimization, "offload_param", None))
    if params != "none" and getattr(zero_optimization, "stage", 3) != 3:
        params += " (no effect below ZeRO stage 3)"
    line = (f"memory options: activation checkpointing {mode} (training.gradient_checkpointing); "
            f"chunked loss {chunk} (training.loss_chunk_tokens); "
            f"offload optimizer {optimizer}, parameters {params} (zero.zero_optimization.offload_optimizer, "
            "offload_param)")
    if tiled_mlp:
        tiles = "ceil(sequence / hidden) tiles" if tiled_mlp is True else f"{tiled_mlp:,} tokens per tile"
        line += f"; tiled MLP, {tiles} (training.tiled_mlp)"
    if offload_activations:
        line += "; checkpointed layers' inputs offloaded to cpu (training.offload_activations)"
    if sequence_parallel_size > 1:
        line += (f"; sequence parallel over {sequence_parallel_size} ranks, 1/{sequence_parallel_size} of each "
                 "sequence per rank (training.sequence_parallel_size)")
    return line


def _offload_device(section: Any) -> str:
    return str(getattr(section, "device", None) or "none")
