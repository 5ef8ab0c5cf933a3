"""Values written into deferred parameters before `initialize`, kept as one slice per rank.

A model built under `zero.Init` has parameters on the meta device until `initialize`
materializes them (init_context.py). Hugging Face's ZeRO-3 loading writes checkpoint
tensors into such parameters before that, one module at a time, inside
`GatheredParameters(params, modifier_rank=0)`. The written value must survive without
any rank holding the whole model: on leaving the context every rank keeps only its
1/world slice of the flattened value (padded so the slices are equal), attached to the
parameter, which goes back to the meta device. `Materializer` all-gathers the slices
into the parameter's bucket, after replaying the parameter's initializers, so a written
value wins over the initializer's.

With more than one rank, `gather_whole` and `initial_value` are collectives: every rank
calls them for the same parameters in the same order (their callers, GatheredParameters
and the materialization, are collective anyway).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.comm import distributed as zdist

_SLICE = "_zerotrain_deferred_slice"  # this rank's slice of the written value (flattened, padded)
INIT_VALUE = "_zerotrain_init_value"  # a small parameter's value from its module's __init__ (rank-local)


def is_deferred(p: object) -> bool:
    """A parameter with no values yet: on the meta device and not in a ZeRO bucket."""
    return isinstance(p, nn.Parameter) and p.is_meta and getattr(p, "_zerotrain_flat_param", None) is None


def has_stored_value(p: nn.Parameter) -> bool:
    """Whether a value was written into the deferred parameter `p` (a slice is kept)."""
    return getattr(p, _SLICE, None) is not None


def stored_numel(p: nn.Parameter) -> int:
    """Elements this rank keeps of `p`'s written value (0 when none): about numel/world."""
    kept = getattr(p, _SLICE, None)
    return 0 if kept is None else kept.numel()


def comm_device() -> torch.device:
    """Where whole values and slices live: the device this rank's collectives run on."""
    return zdist.device_for(zdist.read_launch_env().local_rank)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def store(p: nn.Parameter, whole: torch.Tensor) -> None:
    """Keeps this rank's slice of `whole` (the value every rank agrees `p` now has)."""
    rank, world = _rank_and_world()
    flat = whole.detach().reshape(-1)
    size = math.ceil(flat.numel() / world)
    piece = flat[rank * size : (rank + 1) * size]
    kept = torch.zeros(size, dtype=flat.dtype, device=comm_device())
    kept[: piece.numel()].copy_(piece)  # the last ranks' slices are padded with zeros
    p.__dict__[_SLICE] = kept


def gather_whole(p: nn.Parameter, device: torch.device | None = None) -> torch.Tensor:
    """The value written into `p`, whole, from every rank's slice (a collective), in `p`'s dtype."""
    kept = p.__dict__[_SLICE]
    _, world = _rank_and_world()
    if world > 1:
        flat = torch.empty(kept.numel() * world, dtype=kept.dtype, device=kept.device)
        zdist.all_gather(flat, kept, "init")
    else:
        flat = kept
    whole = flat[: p.numel()].view(p.shape)
    return whole.to(device=device or kept.device, dtype=p.dtype, copy=True)


def initial_value(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    """What a deferred parameter reads as before anything wrote it, on every rank alike.

    A small value its module's `__init__` computed (`nn.Parameter(torch.ones(d))`) is
    rank 0's; anything else reads as zeros: its initializer has not run yet (it runs
    when `initialize` materializes the model), so it has no value to give.
    """
    kept = p.__dict__.get(INIT_VALUE)
    if kept is None or kept.shape != p.shape:
        return torch.zeros(p.shape, dtype=p.dtype, device=device)
    value = kept.to(device=device, dtype=p.dtype, copy=True)
    if _rank_and_world()[1] > 1:
        zdist.broadcast(value, 0, "init")  # __init__ may have drawn random numbers: rank 0's win
    return value


def replace_tensor(p: nn.Parameter, value: torch.Tensor) -> None:
    """Puts the tensor `value` behind the Parameter `p`, keeping its identity (optimizer groups,
    tied modules and names all hold this object) and its attributes."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
    p.__dict__.update(attrs)


def forget(p: nn.Parameter) -> None:
    """Drops what was kept for `p` (once materialized, the bucket holds its value)."""
    for key in (_SLICE, INIT_VALUE, "ds_shape", "ds_numel"):
        p.__dict__.pop(key, None)  # a stage-3 bucket sets ds_shape and ds_numel again when it shards
