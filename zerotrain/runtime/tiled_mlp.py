"""Tiled MLP (`training.tiled_mlp`): each decoder layer's MLP run a tile of tokens at a time.

At long sequences the MLP's intermediate activations (gate, up, their product: about 3 x the
intermediate size per token, 11-14 x the hidden size on Llama shapes) are the largest tensors of a layer.
Here the MLP runs over the tokens a tile at a time under `no_grad`, keeping only its input; backward
recomputes it tile by tile, so at most one tile's intermediates exist at once (DeepSpeed's
`TiledMLP`, ALST). The result is the same computation per token: the output and the input's
gradient equal the untiled ones; each weight's gradient is the sum of the tiles' partial sums, which
differs from one matmul over all tokens by fp32 rounding only.

Unlike DeepSpeed's version, which lets each tile's gradients accumulate into `.grad` (and tells its
ZeRO to wait with `ds_grad_is_ready`), backward here returns each parameter's gradient summed
over the tiles: autograd accumulates once, so every per-parameter gradient hook (zerotrain's
reducer) fires once, as without tiling.

Ranks may run different numbers of tiles. DeepSpeed all-reduces the tile count (MAX) because its
ZeRO-3 gathers parameters in hooks on every submodule, so each tile's call of `gate_proj` is a
collective; zerotrain gathers a whole decoder layer in that layer's hooks and reduces each gradient
once, so a tile issues no collective and agreeing on a count would only add a host synchronisation
per layer. (tests/runtime/test_tiled_mlp.py runs ZeRO-3 with a different sequence length per rank.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zerotrain.config.errors import ConfigError

MLP_ATTR = "mlp"
"""The attribute under which Hugging Face decoder layers (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2) hold their MLP."""
TILED_MARK = "_zerotrain_tiled_mlp"


class TiledMLPFunction(torch.autograd.Function):
    """`forward_fn(x)` over tiles of `tile_rows` rows of `x` (flattened to tokens x hidden), recomputed in backward.

    `params` are the parameters `forward_fn` reads: passed in so that their gradients, summed over
    the tiles, are returned from backward (one accumulation each). `rng_state`: the CPU and device
    random states at forward, restored for the recompute when the MLP has dropout; None otherwise.
    """

    @staticmethod
    def forward(ctx: Any, forward_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_rows: int,
                rng_state: tuple | None, *params: nn.Parameter) -> torch.Tensor:
        ctx.forward_fn, ctx.tile_rows, ctx.rng_state, ctx.params = forward_fn, tile_rows, rng_state, params
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            outputs = [_checked(forward_fn(tile), tile) for tile in rows.split(tile_rows)]
        return torch.cat(outputs).view(*x.shape[:-1], outputs[0].shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[1]
        params = [p for p, wanted in zip(ctx.params, ctx.needs_input_grad[4:]) if wanted]
        rows = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = torch.empty_like(rows) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with restored_rng(ctx.rng_state, x.device), torch.enable_grad():
            start = 0
            for tile in rows.split(ctx.tile_rows):
                tile = tile.detach().requires_grad_(wants_x)
                end = start + tile.shape[0]
                output = ctx.forward_fn(tile)
                inputs = ([tile] if wants_x else []) + params
                grads = torch.autograd.grad(output, inputs, grad_rows[start:end], allow_unused=True)
                if wants_x:
                    grad_x[start:end] = grads[0]
                    grads = grads[1:]
                add_tile_grads(sums, grads)
                start = end
        by_param = iter(sums)
        param_grads = [next(by_param) if wanted else None for wanted in ctx.needs_input_grad[4:]]
        return (None, grad_x.view_as(x) if wants_x else None, None, None, *param_grads)


def add_tile_grads(sums: list[torch.Tensor | None], grads: Iterable[torch.Tensor | None]) -> None:
    """Adds one tile's gradients into `sums` (aligned with them; None: the tile gave that input none), in
    place: the sum over the tiles that a tiled function's backward returns as each input's one gradient."""
    for i, grad in enumerate(grads):
        if grad is not None:
            sums[i] = grad if sums[i] is None else sums[i].add_(grad)


def _checked(output: Any, tile: torch.Tensor) -> torch.Tensor:
    if not isinstance(output, torch.Tensor) or output.shape[0] != tile.shape[0]:
        raise ConfigError(f"training.tiled_mlp: the MLP returned {type(output).__name__}, not one tensor per token; "
                          "only per-token MLPs can be tiled (not mixtures of experts): set training.tiled_mlp: false")
    return output


def rng_state(device: torch.device) -> tuple:
    """The CPU random state and, on a GPU, `device`'s: what `restored_rng` puts back for a recompute."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class restored_rng:
    """The random states of the forward, for the recompute of an MLP with dropout (its masks then match)."""

    def __init__(self, state: tuple | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        if self.state is not None:
            devices = [self.device] if self.device.type == "cuda" else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            torch.set_rng_state(self.state[0])
            if devices:
                torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: Any) -> None:
        if self.state is not None:
            self.fork.__exit__(*exc)


def tile_count(tokens: int, hidden_size: int, tile_tokens: int | None) -> int:
    """Tiles for `tokens` rows: ceil(tokens / tile_tokens), or DeepSpeed's ceil(tokens / hidden_size) when
    `tile_tokens` is None (tiles about as long as the model is wide)."""
    return max(1, math.ceil(tokens / (tile_tokens or hidden_size)))


def enable_tiled_mlp(model: nn.Module, tile_tokens: int | None = None) -> int:
    """Makes every decoder layer's MLP (`<layer>.mlp`) of `model` run tiled; returns how many.

    `tile_tokens`: tokens per tile; None: DeepSpeed's rule, ceil(sequence length / hidden size)
    tiles. In place, like activation checkpointing: parameter names and checkpoints are unchanged.
    ConfigError when the model has no such MLP or one is a mixture of experts.
    """
    mlps = [m for m in (getattr(module, MLP_ATTR, None) for module in model.modules()) if isinstance(m, nn.Module)]
    if not mlps:
        raise ConfigError(f"training.tiled_mlp: {type(model).__name__} has no decoder layer with an `mlp` module; "
                          "set training.tiled_mlp: false")
    for mlp in mlps:
        if not getattr(mlp, TILED_MARK, False):
            _tile(mlp, tile_tokens)
    return len(mlps)


def _tile(mlp: nn.Module, tile_tokens: int | None) -> None:
    name = type(mlp).__name__
    if any(isinstance(m, nn.ModuleList) for m in mlp.modules()) or any(w in name.lower() for w in ("moe", "expert")):
        raise ConfigError(f"training.tiled_mlp: {name} is a mixture of experts, whose routing is not per tile; "
                          "set training.tiled_mlp: false")
    own_forward = mlp.forward
    params = tuple(mlp.parameters())
    has_dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules())

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return own_forward(hidden_states)  # no backward follows: nothing to save memory for
        rows = hidden_states.numel() // hidden_states.shape[-1]
        if tile_tokens is None:  # DeepSpeed's count (from the sequence length), as even tiles of all rows
            tile_rows = -(-rows // tile_count(hidden_states.shape[-2], hidden_states.shape[-1], None))
        else:
            tile_rows = tile_tokens
        rng = rng_state(hidden_states.device) if has_dropout and mlp.training else None
        return TiledMLPFunction.apply(own_forward, hidden_states, tile_rows, rng, *params)

    mlp.forward = forward
    setattr(mlp, TILED_MARK, True)
