"""DeepSpeed's ALST tiled-compute functions (`ulysses_sp.TiledMLP`, `TiledFusedLogitsLoss`,
`sequence_tiled_compute`) with their signatures, on zerotrain's tiled MLP.

`TiledMLP` is exact: zerotrain's `TiledMLPFunction` (zerotrain/runtime/tiled_mlp.py), which returns each
parameter's gradient summed over the tiles (one accumulation, as zerotrain's gradient reducer expects)
instead of DeepSpeed's per-tile accumulation gated by `ds_grad_is_ready`. The other two are refused:
they accumulate per tile by design, which zerotrain's reducer does not follow.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from zerotrain.compat.unsupported_features import NotSupportedByZerotrain
from zerotrain.runtime.tiled_mlp import TiledMLPFunction


class TiledMLP:
    """`TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x_tile)` over `shards` tiles of the
    tokens of `x` ([batch, seq, hidden] or [seq, hidden]), recomputed tile by tile in backward."""

    @staticmethod
    def apply(fn: Callable, self: nn.Module, x: torch.Tensor, shards: int, compute_params: Any = None) -> torch.Tensor:
        """The MLP output for `x`; gradients reach `x` and every parameter of `self` (and `compute_params`)."""
        params = list(compute_params or [])
        known = {id(p) for p in params}
        if isinstance(self, nn.Module):  # DeepSpeed accumulates into every parameter fn touches: so do we
            params += [p for p in self.parameters() if id(p) not in known]
        params = [p for p in params if p.requires_grad]
        rows = x.numel() // x.shape[-1]
        tile_rows = max(1, math.ceil(rows / max(1, int(shards))))
        return TiledMLPFunction.apply(lambda tile: fn(self, tile), x, tile_rows, None, *params)


def _refuse(name: str, instead: str) -> NotSupportedByZerotrain:
    return NotSupportedByZerotrain(
        f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name} is not supported by zerotrain (the `deepspeed` "
        f"package here is zerotrain's stand-in): it accumulates parameter gradients once per tile, which "
        f"zerotrain's ZeRO gradient reduction does not follow. {instead}"
    )


class TiledFusedLogitsLoss:
    """Refused (see the module docstring)."""

    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> torch.Tensor:
        """Raises NotSupportedByZerotrain."""
        raise _refuse("TiledFusedLogitsLoss", "Compute the loss untiled, or use TRL's fused LM head (SFTTrainer).")


def sequence_tiled_compute(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Refused (see the module docstring)."""
    raise _refuse("sequence_tiled_compute", "Use TiledMLP for MLPs, or compute untiled.")
