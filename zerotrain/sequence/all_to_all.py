"""The differentiable all-to-all of Ulysses: sequence shards <-> head shards, exact.

Before attention each of the N ranks holds every head for 1/N of the sequence; after the
exchange it holds 1/N of the heads for the whole sequence, which is what an attention kernel
needs. The backward of an all-to-all is the all-to-all with the two dimensions swapped, so
gradients travel back the same way. One `all_to_all_single` per call (Gloo has it on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, group, split_dim: int, join_dim: int) -> torch.Tensor:
    """Chunk r of `x` along `split_dim` goes to rank r; the chunks received join along `join_dim`
    in rank order."""
    send = torch.stack(x.chunk(dist.get_world_size(group), dim=split_dim))  # [n, ...]: a block per rank
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=join_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split_dim, join_dim):  # type: ignore[override]
        ctx.group, ctx.split_dim, ctx.join_dim = group, split_dim, join_dim
        return _exchange(x, group, split_dim, join_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # The adjoint: what rank r sent as its chunk j comes back from rank j, so swap the dims.
        return _exchange(grad.contiguous(), ctx.group, ctx.join_dim, ctx.split_dim), None, None, None


def all_to_all(x: torch.Tensor, group, split_dim: int, join_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over `group`: `x` is split into N chunks along `split_dim`, chunk
    r is sent to rank r, and the N chunks received are concatenated along `join_dim`.

    `split_dim`'s size must be divisible by the group size. The exchange keeps `x.dtype`
    (DeepSpeed's `seq_parallel_communication_data_type` is the gradient reduction's dtype).
    """
    return _AllToAll.apply(x, group, split_dim, join_dim)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[batch, heads, seq/N, dim] (this rank's slice of the sequence, every head) ->
    [batch, heads/N, seq, dim] (this rank's heads, the whole sequence)."""
    return all_to_all(x, group, split_dim=1, join_dim=2)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[batch, seq, heads/N, dim] (an attention output, transformers' layout) ->
    [batch, seq/N, heads, dim]: back to this rank's slice of the sequence, every head."""
    return all_to_all(x, group, split_dim=1, join_dim=2)
