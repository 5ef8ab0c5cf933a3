"""The causal-LM loss a chunk of tokens at a time (`training.loss_chunk_tokens`).

A model's own loss builds the logits of every token (tokens x vocabulary in the compute dtype),
upcasts them to fp32 and keeps the log-softmax for backward: at a 128K vocabulary and 8K tokens
that is 4 GiB for the fp32 copy alone, often the largest activation of the step. Here the LM head
and the cross-entropy run over `chunk` tokens at a time under a checkpoint: each chunk's logits
are freed once its loss is summed and made again in backward, so at most one chunk's exist.

Under torch.compile (`engine.compile`) each chunk's upcast and cross-entropy are one compiled
function (`compile_chunked_loss`); the head stays eager, so ZeRO-3's hooks on it stay outside the graph.

Only for heads whose logits are the LM head applied to the last hidden state, nothing after it
(no soft-capping or scaling): other models are refused rather than trained on another loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerotrain.config.errors import ConfigError

PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
"""model_type values whose logits are `lm_head(last_hidden_state)` and whose loss is plain cross-entropy."""
IGNORE_INDEX = -100
CROSS_ENTROPY_ATTR = "_zerotrain_chunk_cross_entropy"
"""The attribute of a model with the chunked loss that holds its per-chunk cross-entropy (compiled or not)."""


def check_chunked_loss(model_type: str | None) -> None:
    """ConfigError unless the chunked loss reproduces this model type's own loss (see PLAIN_HEADS)."""
    if model_type not in PLAIN_HEADS:
        raise ConfigError(f"training.loss_chunk_tokens: not supported for model_type {model_type!r} (supported: "
                          f"{', '.join(PLAIN_HEADS)}); remove the key to use the model's own loss")


def enable_chunked_loss(model: nn.Module, chunk_tokens: int) -> None:
    """Replaces `model`'s forward with one whose loss is computed `chunk_tokens` at a time.

    The same call (`model(input_ids=..., labels=...)`) and the same loss as the model's own (the
    mean cross-entropy of each token's next-token prediction, -100 labels left out); `logits` is
    None when `labels` are given. As in transformers' loss, `shift_labels=` gives targets already
    shifted (a sequence-parallel slice's) and `num_items_in_batch=` the divisor of the summed loss.
    Parameter names and checkpoints are unchanged.
    """
    check_chunked_loss(getattr(model.config, "model_type", None))
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base, head = model.base_model, model.get_output_embeddings()
    own_forward = model.forward
    setattr(model, CROSS_ENTROPY_ATTR, chunk_cross_entropy)

    def forward(input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any):
        if labels is None and shift_labels is None:  # generation, evaluation without labels: the model's own
            return own_forward(input_ids=input_ids, **kwargs)
        kwargs.setdefault("use_cache", False)
        hidden = base(input_ids=input_ids, **kwargs).last_hidden_state
        cross_entropy = getattr(model, CROSS_ENTROPY_ATTR)
        loss = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens, cross_entropy, shift_labels, num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward


def compile_chunked_loss(model: nn.Module, compiler: Callable[[Callable], Callable]) -> bool:
    """Replaces the per-chunk cross-entropy of the chunked loss inside `model` (if any) by
    `compiler(it)`; whether there was one."""
    for module in model.modules():
        if CROSS_ENTROPY_ATTR in vars(module):
            setattr(module, CROSS_ENTROPY_ATTR, compiler(chunk_cross_entropy))
            return True
    return False


def chunked_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor | None, head: nn.Module, chunk: int,
                           cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                           shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None) -> torch.Tensor:
    """Mean next-token cross-entropy of `head(hidden)` against `labels` (shifted by one, as the
    models shift them) or `shift_labels` (already shifted: every position has its target),
    `chunk` tokens of the flattened batch at a time; `cross_entropy(logits, targets)` sums a
    chunk's (default `chunk_cross_entropy`). `num_items_in_batch`: divide the sum by this instead
    of the count of targets (1: the sum)."""
    cross_entropy = cross_entropy or chunk_cross_entropy
    if shift_labels is None:
        states, targets = hidden[:, :-1], labels[:, 1:]
    else:
        states, targets = hidden, shift_labels
    states = states.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk):
        total = total + checkpoint(_chunk_loss, states[start : start + chunk], targets[start : start + chunk], head,
                                   cross_entropy, use_reentrant=False)
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def _chunk_loss(states: torch.Tensor, targets: torch.Tensor, head: nn.Module, cross_entropy: Callable) -> torch.Tensor:
    return cross_entropy(head(states), targets)


def chunk_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk, in fp32 as the models' own loss (-100 targets left out)."""
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
