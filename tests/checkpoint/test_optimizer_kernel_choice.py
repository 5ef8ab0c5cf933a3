"""A checkpoint carries training state, not how the saving machine ran its optimizer.

Found on an H100 (2026-11-27): a checkpoint saved by CPU ranks (whose masters take torch's fused
CPU Adam) loaded on a GPU turned on CUDA's fused kernel with the `step` counters left on the CPU,
and the first step failed. The same happens on one machine when the two runs pick different
kernels, which is what this test does on the CPU.
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config


def _train(config: dict, steps: int, load_dir: str | None, save_dir: str | None) -> dict:
    import zerotrain

    model = make_model(seed=0)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    if load_dir:
        engine.load_checkpoint(load_dir)
    kernels = [(g.get("fused"), g.get("foreach")) for g in engine.optimizer.optimizer.param_groups]
    for step in range(steps):
        ids = global_batch(step)[: engine.train_micro_batch_size_per_gpu()]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    if save_dir:
        engine.save_checkpoint(save_dir)
    return {"kernels": kernels, "steps": engine.global_steps}


def test_loading_keeps_this_engines_optimizer_kernel(tmp_path):
    fused = zero_config(2, 1, 1)  # CPU masters: the engine picks torch's fused CPU Adam
    foreach = zero_config(2, 1, 1)
    foreach["optimizer"]["params"]["foreach"] = True  # this run asks for another kernel
    saved = run_on_ranks(1, _train, fused, 2, None, str(tmp_path))[0]
    assert all(f for f, _ in saved["kernels"]), saved
    loaded = run_on_ranks(1, _train, foreach, 1, str(tmp_path), None)[0]
    assert loaded["steps"] == 3
    assert all(not f and e for f, e in loaded["kernels"]), f"the checkpoint's kernel choice was taken: {loaded}"


# --- the choice of kernel, and the scalar state's placement, given a device -------------------------
# No GPU here: the decision and the placement are functions of a device, checked with CUDA and meta
# placements; the meta device stands for "not the CPU" where a tensor must exist.


def test_fp32_masters_on_cpu_or_cuda_take_the_fused_adam_kernel():
    from types import SimpleNamespace

    import torch

    from zerotrain.optim.fused_kernels import takes_fused_adam

    def on(device, dtype=torch.float32):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert takes_fused_adam([on("cuda:0"), on("cuda:1")])
    assert takes_fused_adam([on("cpu")])
    assert not takes_fused_adam([on("cuda:0", torch.bfloat16)])  # masters are fp32; a bf16 param is not one
    assert not takes_fused_adam([on("cuda:0"), on("cpu")])  # one kind of device per optimizer
    assert not takes_fused_adam([on("meta")]) and not takes_fused_adam([])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("saved_dtype", ["float32", "float64"])
@pytest.mark.parametrize("key", ["step", "other"])
def test_a_scalar_state_is_placed_by_the_loading_optimizers_rule_as_torch_places_it(fused, saved_dtype, key):
    import torch

    from zerotrain.optim.fused_kernels import scalar_state

    param = torch.empty(4, device="meta")  # a parameter off the CPU, as on a GPU
    group = {"params": [0], "fused": fused, "capturable": False}
    saved = torch.tensor(3.0, dtype=getattr(torch, saved_dtype))
    expected = torch.optim.Optimizer._process_value_according_to_param_policy(param, saved, 0, [group], key)
    placed = scalar_state(3.0, saved.dtype, key, param, group)
    assert (placed.device, placed.dtype) == (expected.device, expected.dtype)
