"""The loss of a sequence-parallel group: the token-weighted mean over the whole sequence.

Each rank has the logits of its slice. The loss of the group is  L = sum_r S_r / sum_r C_r
(S_r: rank r's summed cross-entropy, C_r: its count of targets that are not -100), the same on
every rank. A rank with no valid target adds S_r = 0 and C_r = 0 (no NaN); a group with none at
all gives 0.

The gradient scale. Every rank back-propagates its own copy of L, so the group as a whole
differentiates N * L: the backward of the sum over ranks is again a sum, which hands each rank
N/C per unit of its own S_r. The engine then averages gradients over the whole world (N x dp
ranks: `zero/grad_reducer.py` divides by the world size), giving (1/dp) * sum_groups dL_g/dθ:
exactly the data-parallel average of the per-group losses that sp = 1 gives over dp ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotrain.sequence.batch_shard import IGNORE_INDEX


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce (sum) of the gradients: the adjoint of
    every rank receiving the sum of every rank's input."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum of `x` over the ranks of `group` (every rank gets the sum)."""
    return _SumOverGroup.apply(x, group)


def slice_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's summed cross-entropy (fp32, as transformers' causal-LM loss upcasts) of `logits`
    [batch, seq/N, vocab] against `shift_labels` [batch, seq/N], and its count of targets."""
    targets = shift_labels.to(logits.device)
    total = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, (targets != IGNORE_INDEX).sum()


def group_token_mean(total: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    """sum_r S_r / sum_r C_r over the ranks of `group`, from this rank's summed loss `total` (S_r)
    and target `count` (C_r): the group's loss, with sp = 1's gradient scale (module docstring)."""
    # One collective for both: the count rides along (its gradient is unused).
    summed = sum_over_group(torch.stack([total, count.to(total.dtype)]), group)
    return summed[0] / summed[1].clamp(min=1)


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """Cross-entropy of this rank's `logits` [batch, seq/N, vocab] against `shift_labels`
    [batch, seq/N] (from `shard_batch`), as the token-weighted mean over the whole sequence of
    the group. Logits are upcast to fp32 as transformers' causal-LM loss does."""
    return group_token_mean(*slice_cross_entropy(logits, shift_labels), group)
