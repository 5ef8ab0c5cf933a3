"""DeepSpeed's ALST tiled compute (`ulysses_sp.TiledMLP`, `sequence_tiled_compute`), exact on zerotrain.

Both run a function over tiles of the sequence without keeping the tiles' activations, and recompute
each tile in backward. DeepSpeed lets each tile's parameter gradients accumulate into `.grad` and
tells its ZeRO to wait with `param.ds_grad_is_ready`; zerotrain's reducer reduces a gradient the
moment autograd accumulates it. So here the parameters are inputs of one autograd function whose
backward returns each parameter's gradient summed over the tiles: autograd accumulates once and
every per-parameter hook fires once, as without tiling. The parameters are `compute_params` plus
every parameter of a module the function receives (`self`, or a module in `kwargs_to_pass`); a
parameter reached any other way (a closure) is refused in backward rather than left without its
gradient. Unlike DeepSpeed, the random state of the forward is restored for the recompute (dropout
masks match), every tensor input that requires a gradient gets one (not only the named one), and
"mean" means the mean of the outputs actually computed (DeepSpeed divides by `shards`, which is not
the tile count when the sequence does not split evenly). `TiledFusedLogitsLoss`: tiled_logits_loss.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.runtime.tiled_mlp import TiledMLPFunction, add_tile_grads, restored_rng, rng_state

REDUCTIONS = (None, "mean", "sum")


class TiledMLP:
    """`TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x_tile)` over `shards` tiles of the
    tokens of `x` ([batch, seq, hidden] or [seq, hidden]), recomputed tile by tile in backward."""

    @staticmethod
    def apply(fn: Callable, self: nn.Module, x: torch.Tensor, shards: int, compute_params: Any = None) -> torch.Tensor:
        """The MLP output for `x`; gradients reach `x` and every parameter of `self` (and `compute_params`)."""
        params = parameters_used(compute_params, [self])
        rows = x.numel() // x.shape[-1]
        tile_rows = max(1, math.ceil(rows / max(1, int(shards))))
        return TiledMLPFunction.apply(lambda tile: fn(self, tile), x, tile_rows, None, *params)


def parameters_used(compute_params: Iterable[torch.Tensor] | None, holders: Iterable[Any]) -> list[torch.Tensor]:
    """The trainable tensors a tiled function may read: `compute_params`, then the parameters of each
    module among `holders`, each once."""
    found: dict[int, torch.Tensor] = {}
    for p in compute_params or ():
        found.setdefault(id(p), p)
    for holder in holders:
        if isinstance(holder, nn.Module):
            for p in holder.parameters():
                found.setdefault(id(p), p)
    return [p for p in found.values() if p.requires_grad]


def refuse_hidden_parameters(output: torch.Tensor, known: Sequence[torch.Tensor], where: str) -> None:
    """Raises if `output`'s graph reaches a trainable leaf that is not in `known`: the tiled function
    reads a parameter it was not given, whose gradient would otherwise be lost without a word."""
    known_ids = {id(t) for t in known}
    seen: set = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in known_ids:
            raise ValueError(
                f"{where}: the function reads a trainable tensor of shape {list(leaf.shape)} that is neither "
                "in compute_params nor a parameter of a module passed to it, so its gradient would be lost: "
                "add it to compute_params"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)


@dataclass
class _TiledCall:
    """What `sequence_tiled_compute` was asked, for its autograd function (which takes tensors only)."""

    fn: Callable
    bounds: list[tuple[int, int]]  # each tile's [start, end) along dim 1 of the sharded inputs
    shard_keys: list[str]
    pass_keys: list[str]
    pass_values: list[Any]  # non-tensors as given; tensors are also passed to the autograd function
    unshard_dim: int
    reduction: str | None


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """`fn(**kwargs_to_shard sliced on dim 1, **kwargs_to_pass)` over `shards` tiles of `seqlen`, concatenated
    on `output_unshard_dimension` (0: each tile's output stacked, the loss case), then reduced by
    `output_reduction` (None, "mean" or "sum"). DeepSpeed's signature; recomputed tile by tile in backward."""
    where = "sequence_tiled_compute"
    if output_reduction not in REDUCTIONS:
        raise ValueError(f"{where}: output_reduction={output_reduction!r}; use None, 'mean' or 'sum'")
    if grad_requiring_tensor_key not in kwargs_to_shard and grad_requiring_tensor_key not in kwargs_to_pass:
        raise ValueError(f"{where}: grad_requiring_tensor_key={grad_requiring_tensor_key!r} is not a key of "
                         f"kwargs_to_shard ({sorted(kwargs_to_shard)}) or kwargs_to_pass ({sorted(kwargs_to_pass)})")
    if int(shards) < 1 or int(seqlen) < 1:
        raise ValueError(f"{where}: seqlen={seqlen} and shards={shards} must both be at least 1")
    for key, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{where}: kwargs_to_shard[{key!r}] is {shape}; each must be a tensor "
                             f"[batch, seqlen={seqlen}, ...], sliced on dim 1")
    step = math.ceil(seqlen / int(shards))
    call = _TiledCall(fn, [(s, min(s + step, seqlen)) for s in range(0, seqlen, step)], list(kwargs_to_shard),
                      list(kwargs_to_pass), list(kwargs_to_pass.values()), output_unshard_dimension, output_reduction)
    params = parameters_used(compute_params, kwargs_to_pass.values())
    passed_tensors = [v for v in kwargs_to_pass.values() if isinstance(v, torch.Tensor)]
    return _SequenceTiledFunction.apply(call, len(kwargs_to_shard), *kwargs_to_shard.values(), *passed_tensors,
                                        *params)


class _SequenceTiledFunction(torch.autograd.Function):
    """Inputs: the call, how many sharded tensors, then the sharded tensors, the passed tensors and the
    parameters. Backward returns a gradient for each of them that requires one."""

    @staticmethod
    def forward(ctx: Any, call: _TiledCall, n_shard: int, *tensors: torch.Tensor) -> torch.Tensor:
        n_passed = sum(isinstance(v, torch.Tensor) for v in call.pass_values)
        ctx.call, ctx.n_shard = call, n_shard
        ctx.save_for_backward(*tensors[: n_shard + n_passed])
        ctx.params = tensors[n_shard + n_passed :]
        sharded = tensors[:n_shard]
        ctx.rng = rng_state(sharded[0].device) if any(ctx.needs_input_grad) else None
        outputs = [call.fn(**_tile(call, sharded, start, end), **_passed(call, tensors[n_shard: n_shard + n_passed]))
                   for start, end in call.bounds]
        ctx.output_shapes = [o.shape for o in outputs]
        if call.unshard_dim == 0:
            whole = torch.cat([o.unsqueeze(0) for o in outputs])
        else:
            whole = torch.cat(outputs, dim=call.unshard_dim)
        ctx.whole_shape = whole.shape
        if call.reduction is None:
            return whole
        return whole.mean() if call.reduction == "mean" else whole.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        call, n_shard = ctx.call, ctx.n_shard
        saved = ctx.saved_tensors
        wants = ctx.needs_input_grad[2:]
        sharded = [t.detach() for t in saved[:n_shard]]
        passed = [t.detach().requires_grad_(w) for t, w in zip(saved[n_shard:], wants[n_shard:])]
        params = list(ctx.params)
        grad_whole = _grad_of_whole(grad_output, call.reduction, ctx.whole_shape)
        grad_sharded = [torch.zeros_like(t) if w else None for t, w in zip(sharded, wants[:n_shard])]
        summed = [t for t, w in zip(passed + params, wants[n_shard:]) if w]  # a gradient summed over the tiles
        sums: list[torch.Tensor | None] = [None] * len(summed)
        offset = 0
        with restored_rng(ctx.rng, sharded[0].device), torch.enable_grad():
            for i, (start, end) in enumerate(call.bounds):
                tile = _tile(call, sharded, start, end)
                tile_leaves = [tile[k].requires_grad_(w) for k, w in zip(call.shard_keys, wants[:n_shard])]
                output = call.fn(**tile, **_passed(call, passed))
                if i == 0:
                    refuse_hidden_parameters(output, tile_leaves + passed + params, "sequence_tiled_compute")
                if call.unshard_dim == 0:
                    grad_tile = grad_whole[i]
                else:
                    width = ctx.output_shapes[i][call.unshard_dim]
                    grad_tile = grad_whole.narrow(call.unshard_dim, offset, width)
                    offset += width
                sliced = [(g, leaf) for g, leaf in zip(grad_sharded, tile_leaves) if g is not None]
                inputs = [leaf for _, leaf in sliced] + summed
                if not inputs or not output.requires_grad:
                    continue
                grads = torch.autograd.grad(output, inputs, grad_tile, allow_unused=True)
                for (g_full, _), grad in zip(sliced, grads):
                    if grad is not None:
                        g_full[:, start:end] = grad
                add_tile_grads(sums, grads[len(sliced):])
        by_input = iter(sums)
        return (None, None, *grad_sharded, *(next(by_input) if w else None for w in wants[n_shard:]))


def _tile(call: _TiledCall, sharded: Sequence[torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {k: v[:, start:end] for k, v in zip(call.shard_keys, sharded)}


def _passed(call: _TiledCall, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """kwargs_to_pass with its tensors replaced by `tensors` (in order): the saved or detached copies."""
    replacements = iter(tensors)
    return {k: next(replacements) if isinstance(v, torch.Tensor) else v
            for k, v in zip(call.pass_keys, call.pass_values)}


def _grad_of_whole(grad_output: torch.Tensor, reduction: str | None, shape: torch.Size) -> torch.Tensor:
    """The gradient of the concatenated (unreduced) output, from the gradient of what forward returned."""
    if reduction is None:
        return grad_output
    if reduction == "mean":
        grad_output = grad_output / math.prod(shape)
    return grad_output.expand(shape)
