"""torch's autograd all_gather gives the right gradient on Gloo sequence groups without rank 0.

transformers' Ulysses loss (`deepspeed_sp_compute_loss`) gathers the per-rank losses with
`torch.distributed.nn.functional.all_gather` over the sequence group; torch's Gloo backward names
the sender by its group rank as a global rank (zerotrain/sequence/gloo_all_to_all_fix.py), so at
sp 2 x dp 2 the group of ranks [2, 3] failed. Building the groups installs the fix.

Exact comparison: every value is a small integer sum, exact in fp32.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_on_ranks


def _gather_gradient() -> dict:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn

    from zerotrain.comm.distributed import init_distributed
    from zerotrain.sequence.gloo_all_to_all_fix import fix_gloo_all_to_all
    from zerotrain.sequence.groups import initialize_sequence_parallel

    rank = init_distributed().rank
    groups = initialize_sequence_parallel(2)  # groups [0, 1] and [2, 3]; installs the fix on Gloo
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    gathered = dist_nn.all_gather(x, group=groups.sequence_group)
    # Member m weighs slice j by (m + 1) * (j + 1): the gradient of x at group position p is
    # (p + 1) * sum over members m of (m + 1), summed across the group by the backward.
    loss = sum((rank + 1) * (j + 1) * part.sum() for j, part in enumerate(gathered))
    loss.backward()
    return {
        "gathered": torch.stack([p.detach() for p in gathered]),
        "grad": x.grad.clone(),
        "position": groups.rank,
        "fix_again": fix_gloo_all_to_all(),
        "backend": dist.get_backend(),
    }


@pytest.mark.slow
def test_all_gather_backward_on_gloo_groups_without_rank0_matches_the_sum_over_members():
    results = run_on_ranks(4, _gather_gradient, timeout=120)
    for rank, got in enumerate(results):
        first = rank - rank % 2
        members = [first, first + 1]
        assert got["backend"] == "gloo"
        expected_gathered = torch.tensor([[m + 1.0] * 3 for m in members])
        torch.testing.assert_close(got["gathered"], expected_gathered, rtol=0, atol=0)
        expected_grad = torch.full((3,), (got["position"] + 1.0) * sum(m + 1 for m in members))
        torch.testing.assert_close(got["grad"], expected_grad, rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank} gradient: {m}")
        assert got["fix_again"] is True  # idempotent: a second call keeps the one replacement
