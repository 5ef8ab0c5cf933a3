"""Ulysses attention for any Hugging Face model: all-to-all around the model's own attention kernel.

Each rank computes q, k, v for its slice of the sequence (rotary embeddings from its global
`position_ids`); `sequence_to_heads` gives it 1/N of the heads over the whole sequence, the
core kernel (SDPA) attends over the whole sequence, and `heads_to_sequence` brings the output
back to the rank's slice. The causal and per-document masks are built from the gathered global
`position_ids`, over the full sequence: the mask the model built for its local slice is dropped.

Installed as DeepSpeed does: the wrapper replaces the core implementation's entry (e.g. "sdpa")
in transformers' `ALL_ATTENTION_FUNCTIONS`, so every code path transformers keys on the
implementation's name stays as it is and only the attention call itself is intercepted.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.config.errors import UserInputError
from zerotrain.sequence.all_to_all import heads_to_sequence, sequence_to_heads

REFUSED_CORES = {
    "eager": "it builds the full [seq x seq] attention matrix (O(seq^2) memory), which is what sequence "
    "parallelism exists to avoid",
    "paged|eager": "it is the eager kernel for generation (O(seq^2) memory)",
}


class SequenceParallelError(UserInputError):
    """A model or batch that sequence parallelism cannot split as given."""


def check_head_split(heads: int, kv_heads: int, sp_size: int) -> None:
    """Raises SequenceParallelError unless N = `sp_size` divides the attention heads and the KV heads
    divide N or N divides them (fewer KV heads than N are replicated, as DeepSpeed does)."""
    if heads % sp_size == 0 and (kv_heads % sp_size == 0 or sp_size % kv_heads == 0):
        return
    sizes = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    raise SequenceParallelError(
        f"sequence_parallel_size {sp_size} cannot split this model's attention: {heads} attention heads and "
        f"{kv_heads} key/value heads (N must divide the attention heads, and the key/value heads must divide N "
        f"or be divisible by it). Sizes that work for this model: {sizes}"
    )


class _LocalHeads:
    """The attention module as the core kernel sees it after the exchange: same module, but the
    GQA group size of the heads this rank holds (it changes when KV heads were replicated)."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class UlyssesAttention:
    """A transformers attention function: `core` (e.g. `sdpa_attention_forward`) run on head shards.

    `group` is the sequence-parallel process group. `disable_in_eval`: in a module's eval mode, run
    `core` directly on the batch as given (DeepSpeed's flag: the Trainer evaluates unsplit batches).
    """

    def __init__(self, core: Callable, core_name: str, group, disable_in_eval: bool = False) -> None:
        self.core, self.core_name, self.group = core, core_name, group
        self.disable_in_eval = disable_in_eval
        self.size = dist.get_world_size(group)
        # One forward passes the same position_ids tensor to every layer: gather and mask once.
        self._positions_seen: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def __call__(self, module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        check_head_split(heads, kv_heads, self.size)
        if kv_heads < self.size:  # each rank needs one KV head: replicate each one N/KV times
            key = key.repeat_interleave(self.size // kv_heads, dim=1)
            value = value.repeat_interleave(self.size // kv_heads, dim=1)
        local_groups = heads // max(kv_heads, self.size)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise SequenceParallelError(
                "sequence parallelism needs the global position_ids of every token in the model's forward "
                "(each rank holds a slice: without them its positions would start at 0); pass the position_ids "
                "that zerotrain.sequence.shard_batch returns"
            )
        mask = self._full_sequence_mask(position_ids, query.shape[0])
        kwargs["position_ids"] = self._positions
        q, k, v = (sequence_to_heads(x, self.group) for x in (query, key, value))
        out, weights = self.core(_LocalHeads(module, local_groups), q, k, v, mask, *args, **kwargs)
        return heads_to_sequence(out, self.group), weights

    def _full_sequence_mask(self, position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
        """None (plain causal: the kernel's fast path) or a boolean [batch, 1, seq, seq] mask, causal
        within each packed document, as transformers builds it at sp=1 from the same position_ids."""
        if position_ids is self._positions_seen:
            return self._mask
        from transformers.masking_utils import find_packed_sequence_indices

        local = position_ids.expand(batch, -1).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        positions = torch.cat(parts, dim=1)
        documents = find_packed_sequence_indices(positions)  # None: one document per row
        mask = None
        if documents is not None:
            seq = positions.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
            mask = (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]
        self._positions_seen, self._positions, self._mask = position_ids, positions, mask
        return mask


def install_ulysses_attention(model: nn.Module, group, disable_in_eval: bool = False) -> UlyssesAttention:
    """Makes `model`'s attention implementation run sequence-parallel over `group`.

    `model` is a transformers model (its `config._attn_implementation` names the core kernel).
    Checks the head counts now, so a model that cannot split fails before training.
    A wrapper already installed over the same group is kept (the engine, given Accelerate's mpu,
    finds the one `register_with_transformers` installed); one over another group is replaced.
    `uninstall_ulysses_attention` restores the core.
    """
    config = getattr(model, "config", None)
    core_name = getattr(config, "_attn_implementation", None)
    if core_name is None:
        raise SequenceParallelError(
            f"sequence parallelism wraps a transformers model's attention, and {type(model).__name__} has no "
            "config._attn_implementation: pass a transformers model (attn_implementation='sdpa')"
        )
    return install_for_config(config, core_name, group, disable_in_eval)


def install_for_config(config: Any, core_name: str, group, disable_in_eval: bool = False) -> UlyssesAttention:
    """`install_ulysses_attention` from a transformers config and the name of the core kernel to wrap
    (DeepSpeed's `register_with_transformers` works before the model exists)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core_name in REFUSED_CORES:
        raise SequenceParallelError(
            f"attn_implementation {core_name!r} cannot run sequence-parallel: {REFUSED_CORES[core_name]}. "
            "Load the model with attn_implementation='sdpa' (or a flash-attention kernel on a GPU)"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    check_head_split(heads, getattr(text, "num_key_value_heads", None) or heads, dist.get_world_size(group))
    installed = ALL_ATTENTION_FUNCTIONS[core_name] if core_name in ALL_ATTENTION_FUNCTIONS else None
    if isinstance(installed, UlyssesAttention) and installed.group is group:
        return installed
    uninstall_ulysses_attention(core_name)
    if core_name not in ALL_ATTENTION_FUNCTIONS:
        raise SequenceParallelError(
            f"attn_implementation {core_name!r} is not one transformers knows: use one of "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
        )
    wrapper = UlyssesAttention(ALL_ATTENTION_FUNCTIONS[core_name], core_name, group, disable_in_eval)
    ALL_ATTENTION_FUNCTIONS[core_name] = wrapper
    return wrapper


def runs_unsplit_in_eval(model: nn.Module) -> bool:
    """Whether `model`'s attention is a Ulysses wrapper that runs eval-mode forwards unsplit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core_name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    installed = ALL_ATTENTION_FUNCTIONS[core_name] if core_name in ALL_ATTENTION_FUNCTIONS else None
    return isinstance(installed, UlyssesAttention) and installed.disable_in_eval


def uninstall_ulysses_attention(core_name: str = "sdpa") -> None:
    """Puts the core kernel back under `core_name` if a Ulysses wrapper is installed there."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    installed = ALL_ATTENTION_FUNCTIONS.get(core_name) if core_name in ALL_ATTENTION_FUNCTIONS else None
    if isinstance(installed, UlyssesAttention):
        ALL_ATTENTION_FUNCTIONS[core_name] = installed.core
