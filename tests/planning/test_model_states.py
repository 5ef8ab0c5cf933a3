"""The model-states estimate equals, to the byte, what the engine allocates on every rank.

Each rank builds a real engine and, for the same model built on the meta device, the
prediction; `engine.memory_breakdown()` is compared with it right after `initialize` and
after one optimizer step (optimizer state is created lazily, except Adagrad's).
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

CPU = {"device": "cpu"}

# (name, model kind, stage, dtype, extra zero_optimization / optimizer settings)
#   "llama": the tiny Llama, trained with two param groups (decay / no decay)
#   "tied_frozen": tied embeddings, one frozen weight and an odd-sized unused head (so buckets are
#       padded to divide among ranks), one param group (initialize's default)
CASES = {
    **{f"llama-fp32-stage{s}": ("llama", s, "fp32", {}) for s in (0, 1, 2, 3)},
    **{f"tied_frozen-bf16-stage{s}": ("tied_frozen", s, "bf16", {}) for s in (0, 1, 2, 3)},
    "llama-bf16-stage1-offload_opt": ("llama", 1, "bf16", {"offload_optimizer": CPU}),
    "llama-bf16-stage2-offload_opt": ("llama", 2, "bf16", {"offload_optimizer": CPU}),
    "llama-bf16-stage3-offload_opt_param": ("llama", 3, "bf16", {"offload_optimizer": CPU, "offload_param": CPU}),
    "tied_frozen-fp32-stage2-offload_opt": ("tied_frozen", 2, "fp32", {"offload_optimizer": CPU}),
    "tied_frozen-fp32-stage3-offload_param": ("tied_frozen", 3, "fp32", {"offload_param": CPU}),
    "llama-bf16-stage3-persistent": ("llama", 3, "bf16", {"stage3_param_persistence_threshold": 100}),
    "llama-fp16-stage2": ("llama", 2, "fp16", {}),
    "llama-bf16-stage2-sgd_momentum": ("llama", 2, "bf16", {"optimizer": ("SGD", {"lr": 0.01, "momentum": 0.9})}),
    "llama-bf16-stage1-adagrad": ("llama", 1, "bf16", {"optimizer": ("Adagrad", {"lr": 0.01})}),
    "tied_frozen-bf16-stage3-lion": ("tied_frozen", 3, "bf16", {"optimizer": ("Lion", {"lr": 1e-4})}),
}
WORLD1_CASES = ["llama-fp32-stage0", "llama-bf16-stage2-offload_opt", "tied_frozen-bf16-stage3"]


def _build(kind: str):
    if kind == "llama":
        model = make_model()
        return model, param_groups(model)
    from torch import nn

    model = make_model(tied=True, freeze_one=True)
    model.odd_head = nn.Linear(32, 7)  # 231 elements, never called: its gradient counts as zeros
    return model, None


def _config(stage: int, dtype: str, world: int, extra: dict) -> dict:
    extra = dict(extra)
    optimizer = extra.pop("optimizer", None)
    cfg = zero_config(stage, world, 1, dtype, **extra)
    if optimizer is not None:
        cfg["optimizer"] = {"type": optimizer[0], "params": optimizer[1]}
    return cfg


def _engine_and_estimate(world: int, names: list[str]) -> dict:
    """On this rank: {case: {"engine": (after init, after step), "estimate": (after init, after step)}}."""
    import torch
    import torch.distributed as dist

    import zerotrain
    from zerotrain.planning.model_states import model_states_per_rank

    out = {}
    for name in names:
        kind, stage, dtype, extra = CASES[name]
        cfg = _config(stage, dtype, world, extra)
        model, groups = _build(kind)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=groups, config=cfg)
        at_init = engine.memory_breakdown()
        rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
        ids = global_batch(0)[rank * micro : (rank + 1) * micro]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        after_step = engine.memory_breakdown()
        engine.destroy()

        with torch.device("meta"):
            meta_model, meta_groups = _build(kind)
        estimate = tuple(
            model_states_per_rank(meta_model, cfg, world, rank, param_groups=meta_groups, after_first_step=stepped)
            for stepped in (False, True)
        )
        out[name] = {"engine": (at_init, after_step), "estimate": estimate}
    return out


@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"world{w}")
def measured(request):
    world = request.param
    names = WORLD1_CASES if world == 1 else list(CASES)
    return world, names, run_on_ranks(world, _engine_and_estimate, world, names)


def test_estimate_equals_memory_breakdown_on_every_rank_after_init_and_after_a_step(measured):
    world, names, per_rank = measured
    mismatches = []
    for rank, results in enumerate(per_rank):
        for name in names:
            r = results[name]
            for when, engine_bytes, estimate in zip(("init", "step"), r["engine"], r["estimate"]):
                if engine_bytes != estimate:
                    mismatches.append(f"world {world} rank {rank} {name} after {when}: {engine_bytes} != {estimate}")
    assert not mismatches, "\n".join(mismatches)


def test_estimate_counts_padding_and_lazy_optimizer_state(measured):
    """The grid is not vacuous: buckets are padded, and Adam's state appears only after a step."""
    from zerotrain.planning.model_states import bucket_layouts
    from zerotrain.zero.stage import StagePlan

    world, names, per_rank = measured
    if world > 1:
        model, _ = _build("tied_frozen")
        trainable = [[p for p in model.parameters() if p.requires_grad]]
        for stage in (1, 2, 3):
            buckets = bucket_layouts(model, trainable, StagePlan(stage), world, 0, 3000, 0)
            assert sum(b.padded_numel - b.numel for b in buckets) > 0
    for name in names:
        init, step = per_rank[0][name]["estimate"]
        if CASES[name][3].get("optimizer") is None:  # AdamW
            assert init["optimizer_state"] == 0 < step["optimizer_state"]
    if "llama-bf16-stage1-adagrad" in names:
        init, step = per_rank[0]["llama-bf16-stage1-adagrad"]["estimate"]
        assert init["optimizer_state"] == step["optimizer_state"] > 0  # built with the optimizer


def test_estimate_runs_on_a_meta_model_without_distributed():
    import torch

    from zerotrain.planning.model_states import MODEL_STATE_KEYS, model_states_per_rank

    with torch.device("meta"):
        model = make_model()
    cfg = zero_config(3, 8, 1, "bf16")
    out = model_states_per_rank(model, cfg, 8, rank=7)
    assert tuple(out) == MODEL_STATE_KEYS
    n = sum(p.numel() for p in model.parameters())
    # stage 3, bf16: 2 + 2 + 4 (master) + 8 (AdamW) bytes per element over 8 ranks, plus padding
    assert 16 * n // 8 <= out["params"] + out["grads"] + out["master"] + out["optimizer_state"] < 16 * (n // 8 + 64)


def test_estimate_of_a_zero_init_model_equals_that_of_a_meta_model():
    import torch

    import zerotrain
    from zerotrain.planning.model_states import model_states_per_rank

    cfg = zero_config(3, 4, 1, "bf16")
    with zerotrain.zero.Init(config_dict_or_path=cfg):
        deferred = make_model()
    with torch.device("meta"):
        meta = make_model()
    assert model_states_per_rank(deferred, cfg, 4, 1) == model_states_per_rank(meta, cfg, 4, 1)


def test_fp32_master_is_a_copy_only_when_the_optimizer_moves_to_another_device():
    import torch

    from zerotrain.planning.model_states import model_states_per_rank

    with torch.device("meta"):
        model = make_model()
    cfg = zero_config(2, 2, 1, "fp32", offload_optimizer={"device": "cpu"})
    on_gpu = model_states_per_rank(model, cfg, 2, device_type="cuda")
    on_cpu = model_states_per_rank(model, cfg, 2, device_type="cpu")
    assert on_cpu["master"] == 0  # "cpu" offload on a CPU run: the master is the parameter itself
    assert on_gpu["master"] == on_gpu["grads"] == on_gpu["params"] // 2  # an fp32 copy of the shard, on the host


def test_nvme_offload_is_refused_rather_than_guessed(tmp_path):
    import torch

    from zerotrain.planning.model_states import model_states_per_rank

    with torch.device("meta"):
        model = make_model()
    cfg = zero_config(3, 2, 1, "bf16", offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    with pytest.raises(NotImplementedError, match="NVMe"):
        model_states_per_rank(model, cfg, 2)
