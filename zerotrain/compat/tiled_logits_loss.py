"""DeepSpeed's `ulysses_sp.TiledFusedLogitsLoss`, exact on zerotrain: the loss over tiles of the tokens,
so the whole sequence's logits never exist at once.

As in DeepSpeed, each tile's backward runs inside forward (the loss is the last operation, so nothing
is recomputed) and the gradients wait for the real backward. Unlike DeepSpeed, which accumulates the
parameters' gradients into `.grad` during forward (outside any backward, gated by
`ds_grad_is_ready`), they are kept and returned from the backward of one autograd function whose
inputs include the parameters, so zerotrain's reducer sees each once (see tiled_compute.py). "mean"
is the mean of the tiles' losses over the tiles actually made (`torch.chunk` makes fewer than
`shards` when the tokens do not split evenly; DeepSpeed's gradient then divides by `shards` anyway).
The gradients are taken for an incoming gradient of 1 and scaled by the real one in backward, as in
DeepSpeed: one fp32 rounding per element more than an untiled loss (sequence_tiled_compute, which
recomputes in backward, has none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerotrain.compat.tiled_compute import parameters_used, refuse_hidden_parameters
from zerotrain.runtime.tiled_mlp import add_tile_grads

WHERE = "TiledFusedLogitsLoss"
X_INPUT = 5  # x's place among _FusedLossFunction's inputs (after fn, owner, shards, reduction, has_mask)


class TiledFusedLogitsLoss:
    """`TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`:
    `fn(self, x_tile, y_tile[, mask_tile])` (a scalar loss) over `shards` tiles of the batch x sequence
    tokens of `x` [batch, seq, ...] and `y` [batch, seq, ...], reduced by "mean" or "sum"."""

    @staticmethod
    def apply(fn: Callable, self: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int,
              compute_params: Iterable[torch.Tensor] | None = None, output_reduction: str = "mean") -> torch.Tensor:
        """The reduced loss; its backward gives `x` and every parameter `fn` reads their exact gradients."""
        _check(x, y, mask, shards, output_reduction)
        params = parameters_used(compute_params, [self])
        extra = (mask,) if mask is not None else ()
        return _FusedLossFunction.apply(fn, self, int(shards), output_reduction, mask is not None, x, y, *extra,
                                        *params)


def _check(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{WHERE}: output_reduction={reduction!r}; use 'mean' or 'sum'")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError(f"{WHERE}: x {list(x.shape)} and y {list(y.shape)} must both be [batch, seq, ...] "
                         "with the same batch and sequence sizes")
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(f"{WHERE}: mask {list(mask.shape)} must be [batch, seq] = {list(x.shape[:2])}")
    if int(shards) < 1:
        raise ValueError(f"{WHERE}: shards={shards}; use 1 or more")


class _FusedLossFunction(torch.autograd.Function):
    """Inputs: fn, self, shards, reduction, whether a mask follows, then x, y, [mask], the parameters."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, owner: Any, shards: int, reduction: str, has_mask: bool,
                x: torch.Tensor, y: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, params = (rest[0], rest[1:]) if has_mask else (None, rest)
        wants_x = ctx.needs_input_grad[X_INPUT]
        ctx.param_wants = ctx.needs_input_grad[X_INPUT + 2 + has_mask:]  # after x, y and the mask
        wanted = [p for p, w in zip(params, ctx.param_wants) if w]
        # Flattened to tokens: a tile of [batch * seq] rows keeps strides simple whatever the batch size.
        rows = x.detach().reshape(-1, *x.shape[2:])
        tiles = list(zip(rows.chunk(shards), y.detach().reshape(-1, *y.shape[2:]).chunk(shards),
                         *([mask.detach().reshape(-1).chunk(shards)] if has_mask else [])))
        weight = 1.0 / len(tiles) if reduction == "mean" else 1.0
        grad_rows = torch.empty_like(rows) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        losses, start = [], 0
        for i, (x_tile, *others) in enumerate(tiles):
            if not (wants_x or wanted):
                losses.append(fn(owner, x_tile, *others))
                continue
            x_tile = x_tile.requires_grad_(wants_x)
            with torch.enable_grad():
                loss = fn(owner, x_tile, *others)
            if i == 0:
                refuse_hidden_parameters(loss, [x_tile, *params], WHERE)
            losses.append(loss.detach())
            inputs = ([x_tile] if wants_x else []) + wanted
            grads = list(torch.autograd.grad(loss, inputs, torch.full_like(loss, weight), allow_unused=True))
            if wants_x:
                grad_rows[start: start + x_tile.shape[0]] = grads.pop(0)
            add_tile_grads(sums, grads)
            start += x_tile.shape[0]
        ctx.grad_x = grad_rows.view(x.shape) if wants_x else None
        ctx.param_grads = iter(sums)
        ctx.has_mask = has_mask
        stacked = torch.stack(losses)
        return stacked.mean() if reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        # The gradients were taken for a loss gradient of 1; scale in place (no host read of grad_loss).
        grad_x = ctx.grad_x.mul_(grad_loss) if ctx.grad_x is not None else None
        param_grads = []
        for wanted in ctx.param_wants:
            grad = next(ctx.param_grads) if wanted else None
            param_grads.append(grad.mul_(grad_loss) if grad is not None else None)
        ctx.grad_x = ctx.param_grads = None
        return (None, None, None, None, None, grad_x, None, *([None] if ctx.has_mask else []), *param_grads)
