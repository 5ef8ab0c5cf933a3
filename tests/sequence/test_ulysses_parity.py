"""Ulysses sequence parallelism reproduces sp = 1 on the same global batch: loss and every gradient.

One spawn of 4 Gloo ranks runs every case (sp 2 x dp 2 and sp 4; ZeRO stages 0-3 and CPU offload;
2 KV heads, and 1 KV head, fewer than sp, replicated; two micro-steps per step; bf16). The batch
(ulysses_workload.py) holds packed documents, a right-padded row and labels -100 over whole ranks' slices.

Tolerance: rtol 1e-5 (fp32). Sequence parallelism changes only summation order (attention over
head shards, the loss summed over ranks, gradients summed over 4 ranks in buckets), which moves
fp32 results by a few units of the last place; elements of a gradient that are near zero are
compared within 1e-6 of that tensor's largest entry, since their absolute rounding follows the
tensor's scale, not their own.
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import run_on_ranks
from ulysses_workload import engine_step, loss_with_no_target, reference_step

WORLD = 4
CPU = {"device": "cpu", "pin_memory": False}
CASES = {  # name: (kv heads, sp, stage, offload[, micro-steps per step])
    **{f"kv2-sp{sp}-stage{stage}": (2, sp, stage, None) for sp in (2, 4) for stage in (0, 1, 2, 3)},
    "kv1-sp2-stage2": (1, 2, 2, None),
    "kv1-sp4-stage0": (1, 4, 0, None),
    "kv1-sp4-stage3": (1, 4, 3, None),
    "kv2-sp2-stage2-offload-opt": (2, 2, 2, {"offload_optimizer": CPU}),
    "kv2-sp4-stage3-offload-both": (2, 4, 3, {"offload_optimizer": CPU, "offload_param": CPU}),
    "kv2-sp2-stage2-accum2": (2, 2, 2, None, 2),
    "kv1-sp2-stage3-accum2": (1, 2, 3, None, 2),
}
BF16_CASE = (2, 2, 3)  # kv heads, sp, stage: bf16 compute, fp32 master weights


def _all_cases() -> dict:
    out = {name: engine_step(*case) for name, case in CASES.items()}
    out["bf16"] = engine_step(*BF16_CASE, dtype="bf16")
    out["no-target"] = loss_with_no_target()
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_on_ranks(WORLD, _all_cases, timeout=300)


@functools.cache
def _reference(kv_heads: int, sp: int, gas: int = 1) -> tuple[list[list[float]], dict]:
    return reference_step(kv_heads, sp, WORLD, gas)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_loss_and_gradients_equal_sp1(per_rank, name):
    kv_heads, sp, _, _, *gas = CASES[name]
    ref_losses, ref_grads = _reference(kv_heads, sp, *gas)
    for rank, result in enumerate(per_rank):
        got = result[name]
        torch.testing.assert_close(got["losses"], ref_losses[got["dp_rank"]], rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {rank} loss: {m}")
        for param, ref in ref_grads.items():
            torch.testing.assert_close(got["grads"][param], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()),
                                       msg=lambda m: f"rank {rank} {param}: {m}")


@pytest.mark.slow
def test_sequence_parallel_in_bf16_trains_as_fp32_sp1_to_bf16_precision(per_rank):
    # bf16 rounds activations and the all-to-all to 8 bits of mantissa: each gradient within 3% of the
    # fp32 sp = 1 one (norm-wise). A wrong head or sequence split moves gradients by their own size.
    ref_losses, ref_grads = _reference(*BF16_CASE[:2])
    for rank, result in enumerate(per_rank):
        got = result["bf16"]
        torch.testing.assert_close(got["losses"], ref_losses[got["dp_rank"]], rtol=2e-2, atol=0)
        for param, ref in ref_grads.items():
            error = float((got["grads"][param] - ref).norm())
            assert error <= 3e-2 * float(ref.norm()), (rank, param, error / float(ref.norm()))


@pytest.mark.slow
def test_the_batch_leaves_some_ranks_without_a_target(per_rank):
    """The zero-token cases really happen: sp 4's rank 1, and sp 2 x dp 2's last rank."""
    assert per_rank[1]["kv2-sp4-stage0"]["local_targets"] == 0
    assert per_rank[3]["kv2-sp2-stage0"]["local_targets"] == 0
    assert all(per_rank[r]["kv2-sp4-stage0"]["local_targets"] > 0 for r in (0, 2, 3))


@pytest.mark.slow
def test_a_group_without_any_target_has_loss_zero_not_nan(per_rank):
    assert [r["no-target"] for r in per_rank] == [{"loss": 0.0, "grad_finite": True}] * WORLD


@pytest.mark.slow
def test_a_forward_without_global_position_ids_is_refused(per_rank):
    """Without them each rank would number its slice from 0: read as packed documents, silently wrong."""
    message = per_rank[1]["kv2-sp2-stage0"]["missing_positions"]
    assert "every forward needs position_ids=" in message and "shard_batch" in message
