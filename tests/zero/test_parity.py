"""Every ZeRO stage reproduces single-process training on the same global batch.

One spawn per world size runs every (stage, accumulation) case; the tests below
check each case against the plain-torch reference. On a GPU the same cases run as a
world of 1 over NCCL (`gpu-world1`), against a reference trained on the same GPU.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from conftest import on_gpu, run_on_ranks
from llama_workload import GLOBAL_BATCH, STEPS, train_reference, train_zerotrain, zero_config

# fp32 must equal the reference up to summation order, so a fault shows within a few steps. Five
# cover Adam's first step and four on carried state, clipped and unclipped steps (global gradient
# norms 0.95, 1.05, 0.98, 1.41, 1.95 against a clip of 1), stage 3's recorded order then its
# prefetch, and NVMe write-then-read of every shard; the loss falls 4.18 -> 3.68.
FP32_STEPS = 5
# Half precision drifts from fp32 step by step (bf16: ~1e-4 relative at step 5, ~2e-3 at step 10):
# its tolerance is only tested on the longer run.
HALF_STEPS = STEPS


def _steps(dtype: str) -> int:
    return FP32_STEPS if dtype == "fp32" else HALF_STEPS


STAGES = (0, 1, 2, 3)
ACCUMULATION = (1, 2)
# DeepSpeed's knobs for where the 1/N of the average is applied: the result must not change.
SCALING_CASES = (
    ("prescale", 1, {"prescale_gradients": True}),
    ("predivide", 0, {"gradient_predivide_factor": 2.0}),
    ("predivide-stage2", 2, {"gradient_predivide_factor": 2.0}),
)


def _all_cases(world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for stage in STAGES:
        for gas in ACCUMULATION:
            run = train_zerotrain(zero_config(stage, world, gas), FP32_STEPS)
            out[(stage, gas)] = {"losses": run["losses"], "weights": run["weights"]}
    for stage in STAGES:
        for dtype in ("bf16", "fp16"):
            run = train_zerotrain(zero_config(stage, world, 1, dtype), HALF_STEPS)
            out[(stage, dtype)] = {"losses": run["losses"], "weights": run["weights"]}
    for name, stage, extra in SCALING_CASES:
        run = train_zerotrain({**zero_config(stage, world, 1), **extra}, FP32_STEPS)
        out[name] = {"losses": run["losses"], "weights": run["weights"]}
    for name, stage, dtype, gas, offload in OFFLOAD_CASES:
        run = train_zerotrain(zero_config(stage, world, gas, dtype, **offload), _steps(dtype))
        out[name] = {"losses": run["losses"], "weights": run["weights"]}
    run = train_zerotrain({**zero_config(2, world, 1, "bf16"), "communication_data_type": "fp32"}, HALF_STEPS)
    out["bf16-fp32-comm"] = {"losses": run["losses"], "weights": run["weights"]}
    for stage, key in ((2, "features"), (3, "features-stage3")):
        run = train_zerotrain(zero_config(stage, world, 2), FP32_STEPS, tied=True, extra_unused=True, freeze_one=True)
        module = run["engine"].module
        out[key] = {
            "losses": run["losses"],
            "weights": run["weights"],
            "tied_shared": module.lm_head.weight is module.model.embed_tokens.weight,
        }
    dist.barrier()
    return out


CPU = {"device": "cpu", "pin_memory": True}
NVME = {"device": "nvme", "nvme_path": tempfile.gettempdir()}  # each store makes its own private folder
# Parameter shards on NVMe: none cached (every gather reads, every step writes), or a few.
NVME_PARAM = {**NVME, "max_in_cpu": 0, "buffer_count": 2}
NVME_PARAM_CACHED = {**NVME, "max_in_cpu": 6000}
OFFLOAD_CASES = (  # (name, stage, dtype, accumulation steps, zero_optimization keys)
    # small sub-groups: the optimizer steps the shards a few buckets at a time
    ("offload-opt-stage2", 2, "fp32", 2, {"offload_optimizer": CPU, "sub_group_size": 2000}),
    ("offload-opt-stage3", 3, "fp32", 2, {"offload_optimizer": CPU}),
    ("offload-both-stage3", 3, "fp32", 2, {"offload_optimizer": CPU, "offload_param": CPU}),
    ("offload-both-stage3-bf16", 3, "bf16", 2, {"offload_optimizer": CPU, "offload_param": CPU}),
    ("nvme-opt-stage2", 2, "fp32", 2, {"offload_optimizer": NVME, "sub_group_size": 2000}),
    ("nvme-opt-stage3-bf16", 3, "bf16", 2, {"offload_optimizer": NVME, "sub_group_size": 2000}),
    # ZeRO-Infinity: parameters on NVMe, with the optimizer state on NVMe, on the CPU, or not offloaded
    ("nvme-both-stage3", 3, "fp32", 1, {"offload_optimizer": NVME, "offload_param": NVME_PARAM, "sub_group_size": 900}),
    ("nvme-both-stage3-accum", 3, "fp32", 2, {"offload_optimizer": NVME, "offload_param": NVME_PARAM_CACHED}),
    ("nvme-param-cpu-opt-stage3-accum", 3, "fp32", 2, {"offload_optimizer": CPU, "offload_param": NVME_PARAM}),
    ("nvme-param-stage3", 3, "fp32", 1, {"offload_param": NVME_PARAM_CACHED}),
    ("nvme-both-stage3-bf16", 3, "bf16", 2, {"offload_optimizer": NVME, "offload_param": NVME_PARAM}),
)


@pytest.fixture(scope="module", params=[(2, "cpu"), pytest.param((4, "cpu"), marks=pytest.mark.slow, id="world4"),
                                        on_gpu((1, "gpu"), "gpu-world1")],
                ids=lambda p: f"world{p[0]}")
def world_runs(request):
    """(world size, device, per-rank results of every case)."""
    world, device = request.param
    return world, device, run_on_ranks(world, _all_cases, world, device=device)


@functools.cache
def _reference(device: str, steps: int, features: bool = False) -> tuple[list[float], dict]:
    """The plain-torch run, once per module whatever the world size (it has none)."""
    kwargs = {"tied": True, "extra_unused": True, "freeze_one": True} if features else {}
    return train_reference(steps, device=device, **kwargs)


@pytest.fixture
def reference(world_runs):
    """The fp32 cases' reference (FP32_STEPS long)."""
    return _reference(world_runs[1], FP32_STEPS)


@pytest.fixture
def half_reference(world_runs):
    """The half-precision cases' reference (HALF_STEPS long)."""
    return _reference(world_runs[1], HALF_STEPS)


def _global_losses(per_rank: list[dict], key) -> list[float]:
    """Mean over ranks of each rank's step loss: the loss of the whole global batch."""
    losses = [r[key]["losses"] for r in per_rank]
    return [sum(step) / len(step) for step in zip(*losses)]


def _assert_weights_close(weights: dict, ref: dict, rtol: float) -> None:
    """Each tensor within `rtol` of the reference, relative to its norm.

    (Element-wise, Adam turns last-bit differences of near-zero gradients, which any
    change of summation order makes, into larger relative changes of single weights.)
    """
    for name, ref_w in ref.items():
        err = (weights[name] - ref_w).norm() / ref_w.norm()
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("gas", ACCUMULATION, ids=lambda g: f"accum{g}")
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}")
def test_fp32_stage_matches_single_process_training(world_runs, reference, stage, gas):
    world, _, per_rank = world_runs
    ref_losses, ref_weights = reference
    assert GLOBAL_BATCH % (world * gas) == 0
    losses = _global_losses(per_rank, (stage, gas))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0] - 0.1, "the run should be learning"
    for r in per_rank:  # every rank ends with the same, reference weights
        _assert_weights_close(r[(stage, gas)]["weights"], ref_weights, rtol=1e-5)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("dtype,tol", [("bf16", 3e-2), ("fp16", 1e-2)])
def test_half_precision_follows_fp32_within_tolerance(world_runs, half_reference, stage, dtype, tol):
    """bf16 keeps 8 bits of mantissa, fp16 11: the loss curve stays within `tol` (relative) of fp32."""
    _, _, per_rank = world_runs
    ref_losses, _ = half_reference
    losses = _global_losses(per_rank, (stage, dtype))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=0.0)


@pytest.mark.parametrize("case", [c[0] for c in SCALING_CASES])
def test_gradient_prescaling_and_predivision_do_not_change_training(world_runs, reference, case):
    _, _, per_rank = world_runs
    ref_losses, ref_weights = reference
    torch.testing.assert_close(torch.tensor(_global_losses(per_rank, case)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_weights_close(per_rank[0][case]["weights"], ref_weights, rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in OFFLOAD_CASES], ids=[c[0] for c in OFFLOAD_CASES])
def test_offload_matches_single_process_training(world_runs, case):
    name, _, dtype, _, _ = case
    _, device, per_rank = world_runs
    ref_losses, ref_weights = _reference(device, _steps(dtype))
    rtol = 1e-5 if dtype == "fp32" else 3e-2
    torch.testing.assert_close(torch.tensor(_global_losses(per_rank, name)), torch.tensor(ref_losses), rtol=rtol, atol=1e-6)
    if dtype == "fp32":
        _assert_weights_close(per_rank[0][name]["weights"], ref_weights, rtol=1e-5)


def test_bf16_with_fp32_communication_follows_fp32(world_runs, half_reference):
    _, _, per_rank = world_runs
    ref_losses, _ = half_reference
    torch.testing.assert_close(torch.tensor(_global_losses(per_rank, "bf16-fp32-comm")), torch.tensor(ref_losses), rtol=3e-2, atol=0.0)


@pytest.mark.parametrize("key", ["features", "features-stage3"])
def test_tied_frozen_and_unused_parameters_match_reference(world_runs, key):
    _, device, per_rank = world_runs
    ref_losses, ref_weights = _reference(device, FP32_STEPS, features=True)
    ref_weights = dict(ref_weights)  # the cached reference stays whole: the unused head is taken out below
    torch.testing.assert_close(torch.tensor(_global_losses(per_rank, key)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # torch.optim skips a parameter whose grad is None, while ZeRO (like DeepSpeed) steps it with a
    # zero gradient, so weight decay still shrinks the unused head: compare it separately.
    ref_unused = {n: ref_weights.pop(n) for n in list(ref_weights) if n.startswith("unused_head")}
    for r in per_rank:
        features = r[key]
        assert features["tied_shared"], "lm_head and embed_tokens must stay one tensor"
        _assert_weights_close(features["weights"], ref_weights, rtol=1e-5)
        decay = (1 - 1e-2 * 0.1) ** FP32_STEPS
        torch.testing.assert_close(features["weights"]["unused_head.weight"], ref_unused["unused_head.weight"] * decay)
