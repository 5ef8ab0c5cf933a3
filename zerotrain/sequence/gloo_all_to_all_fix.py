"""A workaround for a torch bug: the autograd `all_gather`'s backward on a Gloo subgroup.

`torch.distributed.nn.functional.all_gather` (what transformers' and Accelerate's Ulysses loss
call over the sequence group) runs its backward through `_AlltoAll`, whose Gloo branch calls
`dist.scatter(out, to_send, i, group=group)` with the GROUP rank `i` as the GLOBAL `src`. That is
right only for a group whose ranks are 0..k-1 in the world; for any other group (the sequence
groups of sp x dp > 1: ranks [2, 3] of 4) the scatter names a rank outside the group and fails,
or names the wrong sender. Present in torch 2.13 (torch/distributed/nn/functional.py, `_AlltoAll`).

`fix_gloo_all_to_all()` replaces that forward by one that passes `group_src=i`; NCCL and other
backends keep torch's own path. It changes nothing on a torch whose code no longer has the bug.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.nn import functional as dist_nn

_BUGGY_CALL = "dist.scatter(out_tensor_list[i], to_send, i, group=group)"
_torch_forward = dist_nn._AlltoAll.forward  # kept for the other backends


def _forward_with_group_src(ctx, group, out_tensor_list: list, *tensors: torch.Tensor) -> tuple:
    if dist.get_backend(group=group) != dist.Backend.GLOO:
        return _torch_forward(ctx, group, out_tensor_list, *tensors)
    size = dist.get_world_size(group=group)
    ctx.group = group
    ctx.input_tensor_size_list = [tensors[i].size() for i in range(size)]
    my_rank = dist.get_rank(group=group)
    tensors = tuple(t.contiguous() for t in tensors)
    # torch's own Gloo emulation of all_to_all (scatter from each member in turn), with the sender
    # named by its rank in the group.
    for i in range(size):
        dist.scatter(out_tensor_list[i], list(tensors) if i == my_rank else None, group=group, group_src=i)
    return tuple(out_tensor_list)


def _torch_has_bug() -> bool:
    try:
        return _BUGGY_CALL in inspect.getsource(_torch_forward)
    except (OSError, TypeError):  # no sources shipped: assume the bug, the replacement is correct either way
        return True


def fix_gloo_all_to_all() -> bool:
    """Installs the group-rank-correct Gloo branch into torch's autograd `_AlltoAll` (idempotent).

    Returns whether the replacement is in place (False when this torch no longer has the bug)."""
    if dist_nn._AlltoAll.forward is _forward_with_group_src:
        return True
    if not _torch_has_bug():
        return False
    dist_nn._AlltoAll.forward = staticmethod(_forward_with_group_src)
    return True
