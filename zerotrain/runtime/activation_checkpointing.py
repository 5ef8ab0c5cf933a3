"""Activation checkpointing of a Hugging Face model: whole layers, or selective.

Whole layers (True): each decoder layer keeps only its input and recomputes its forward in backward.
Selective ("selective", torchtitan's per-op policy): inside each checkpointed layer the outputs of
matrix multiplies and of the attention kernel are kept; everything else (norms, rotary, SiLU, the
gate product, dtype casts) is recomputed from them. Those cheap ops own most of a layer's saved
bytes and almost none of its FLOPs, so this keeps about half of what no checkpointing keeps while
recomputing a few percent of the FLOPs. The planner counts both (planning/activation_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from zerotrain.config.errors import ConfigError

_aten = torch.ops.aten
_KEPT_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
KEPT_OPS = frozenset(getattr(_aten, name).default for name in _KEPT_NAMES if hasattr(_aten, name))
"""The ops whose outputs selective checkpointing keeps (those this torch has)."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_watchers: list[Callable[[Any], None]] = []


def selective_checkpoint_context():
    """A fresh (forward, recompute) context pair per checkpointed call, as `checkpoint(context_fn=...)` asks."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    for watch in _watchers:
        watch(forward)
    return forward, recompute


@contextmanager
def kept_by_selective_checkpointing() -> Iterator[Callable[[], dict[int, int]]]:
    """Within the block, `kept()` gives the storages selective checkpointing holds for backward, as
    {data_ptr: bytes}: what `saved_tensors_hooks` does not see. `zerotrain plan --verify` and the tests measure
    the planner's activation estimate with it."""
    modes: list[Any] = []
    _watchers.append(modes.append)

    def kept() -> dict[int, int]:
        storages: dict[int, int] = {}

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                if value.numel():
                    storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            elif hasattr(value, "val") and hasattr(value, "version"):  # torch >= 2.6 wraps each kept output
                walk(value.val)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)

        for mode in modes:
            walk(dict(mode.storage))  # torch's cache of the kept outputs (an attribute since torch 2.4)
        return storages

    try:
        yield kept
    finally:
        _watchers.remove(modes.append)


def enable_gradient_checkpointing(model: nn.Module, mode: bool | str = True) -> None:
    """Checkpoints each decoder layer of `model`: `mode` True (whole layers) or "selective"; False: nothing.

    Non-reentrant checkpointing: it works with frozen inputs and with ZeRO-3's hooks, and the KV
    cache is switched off, which checkpointing cannot use anyway.
    """
    if mode not in (False, True, "selective"):
        raise ConfigError(f"gradient checkpointing must be false, true or \"selective\", got {mode!r}")
    if mode is False:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"{type(model).__name__} does not support gradient checkpointing; "
            "set training.gradient_checkpointing: false"
        )
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_checkpoint_context
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; 4.x has only the old name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
