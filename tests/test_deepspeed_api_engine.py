"""DeepSpeed's engine API, checked against values DeepSpeed itself gave: accessors,
save_16bit_model, schedulers with `warmup_num_steps: 0`, and what the HF Trainer and
Accelerate call on the engine.

The expected values were recorded by running DeepSpeed on CPU (DS_ACCELERATOR=cpu, one
process, torch 2.13.0) on the same model and configs as below: DeepSpeed 0.19.8 for the
engine accessors, DeepSpeed 0.19.2 for `warmup_num_steps: 0` (0.19.3 and later reject 0;
0.19.2 and earlier accept it and warm up over 2 steps). DeepSpeed is not a test dependency:
the values are written here.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import zerotrain

ADAM = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.95]}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _engine(model: nn.Module | None = None, client_optimizer=None, **config):
    cfg = {"train_batch_size": 2, "steps_per_print": 1000, **config}
    if client_optimizer is None:
        cfg.setdefault("optimizer", ADAM)
    engine, *_ = zerotrain.initialize(model=model or _model(), optimizer=client_optimizer, config=cfg)
    return engine


def _train(engine, steps: int, overflow_at: int | None = None) -> list[dict]:
    """Runs `steps` engine.step() calls; after each, what DeepSpeed's script recorded."""
    trace = []
    for i in range(steps):
        x = torch.randn(2, 4)
        loss = engine(x).float().pow(2).mean()
        if i == overflow_at:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        trace.append(
            {"applied": engine.was_step_applied(), "skipped": engine.skipped_steps, "global_steps": engine.global_steps}
        )
    return trace


# --- accessors (DeepSpeed 0.19.8, single process) ---------------------------------------------


@pytest.mark.parametrize("stage, expected", [(0, False), (1, True), (2, True), (3, True)])
def test_zero_optimization_is_a_bool_true_from_stage_1(stage, expected):
    engine = _engine(zero_optimization={"stage": stage})
    assert engine.zero_optimization() is expected
    assert engine.zero_optimization_stage() == stage


def test_gradient_clipping_returns_the_configured_max_norm():
    assert _engine(gradient_clipping=0.5).gradient_clipping() == 0.5


def test_get_mom_returns_each_groups_betas_for_adam():
    assert _engine().get_mom() == [(0.8, 0.95)]  # a tuple, as DeepSpeed returns it


def test_get_mom_returns_momentum_for_sgd_from_config_or_client():
    from_config = _engine(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    model = _model()
    client = _engine(model, client_optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.7))
    assert from_config.get_mom() == [0.9]
    assert client.get_mom() == [0.7]


def test_get_mom_is_zero_for_an_optimizer_without_betas():
    model = _model()
    assert _engine(model, client_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1)).get_mom() == [0.0]


def test_was_step_applied_only_after_an_accumulation_boundary():
    engine = _engine(train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    assert engine.was_step_applied() is False
    trace = _train(engine, 4)
    assert [t["applied"] for t in trace] == [False, True, False, True]
    assert [t["global_steps"] for t in trace] == [0, 1, 1, 2]


def test_was_step_applied_is_false_after_an_fp16_overflow_skip():
    engine = _engine(fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 8})
    trace = _train(engine, 3, overflow_at=1)
    assert trace == [
        {"applied": True, "skipped": 0, "global_steps": 1},
        {"applied": False, "skipped": 1, "global_steps": 2},
        {"applied": True, "skipped": 1, "global_steps": 3},
    ]


def test_global_rank_and_dp_world_size_on_one_process():
    engine = _engine()
    assert (engine.global_rank, engine.dp_world_size) == (0, 1)


# --- save_16bit_model / save_fp16_model --------------------------------------------------------


def test_save_16bit_model_takes_deepspeeds_arguments():
    from zerotrain.runtime.engine import Engine

    params = list(inspect.signature(Engine.save_16bit_model).parameters)
    assert params == ["self", "save_dir", "save_filename", "exclude_frozen_parameters"]
    assert list(inspect.signature(Engine.save_fp16_model).parameters) == ["self", "save_dir", "save_filename"]


def test_save_16bit_model_to_a_bin_name_writes_a_weights_only_torch_file(tmp_path):
    engine = _engine(zero_optimization={"stage": 2})
    _train(engine, 1)
    assert engine.save_16bit_model(tmp_path, "pytorch_model.bin") is True
    weights = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(weights) == set(engine.module.state_dict())
    for name, p in engine.module.named_parameters():
        assert torch.equal(weights[name], p.detach())


def test_save_16bit_model_can_exclude_frozen_parameters(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    model[0].weight.requires_grad_(False)
    engine = _engine(model, zero_optimization={"stage": 1})
    assert engine.save_16bit_model(tmp_path, exclude_frozen_parameters=True) is True
    assert set(load_file(tmp_path / "model.safetensors")) == {"0.bias", "2.weight", "2.bias"}


def test_save_fp16_model_is_save_16bit_model_under_the_old_name(tmp_path):
    from safetensors.torch import load_file

    engine = _engine()
    assert engine.save_fp16_model(tmp_path / "old") is True
    engine.save_16bit_model(tmp_path / "new")
    old, new = load_file(tmp_path / "old" / "model.safetensors"), load_file(tmp_path / "new" / "model.safetensors")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)


def test_save_16bit_model_at_stage_3_needs_the_gather_flag_like_deepspeed(tmp_path):
    engine = _engine(zero_optimization={"stage": 3})
    assert engine.save_16bit_model(tmp_path) is False
    assert not (tmp_path / "model.safetensors").exists()


# --- WarmupLR and friends with warmup_num_steps 0 (DeepSpeed 0.19.2) ---------------------------

# lr after initialize, then after each of 5 steps; Adam lr 1e-3 as the optimizer's own lr.
WARMUP_ZERO = {
    "WarmupLR log": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 0}},
        [0.001, 0.001, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002],
    ),
    "WarmupLR linear": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 0,
                                        "warmup_type": "linear"}},
        [0.001, 0.001, 0.0055000000000000005, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002],
    ),
    "WarmupDecayLR linear": (
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                             "warmup_num_steps": 0, "warmup_type": "linear"}},
        [0.001, 0.001, 0.0055000000000000005, 0.010000000000000002, 0.007750000000000001, 0.0055000000000000005],
    ),
    "WarmupCosineLR linear": (
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_min_ratio": 0.1, "warmup_num_steps": 0,
                                              "warmup_type": "linear"}},
        [0.0, 0.0001, 0.00055, 0.0008535680352542144, 0.00050005, 0.0001465319647457856],
    ),
}


@pytest.mark.parametrize("name", list(WARMUP_ZERO))
def test_warmup_num_steps_zero_is_accepted_with_deepspeeds_lrs(name):
    scheduler, expected = WARMUP_ZERO[name]
    engine = _engine(scheduler=scheduler)
    lrs = [engine.get_lr()[0]]
    for _ in range(5):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)


# --- what the HF Trainer and Accelerate call on the engine -------------------------------------


def test_engine_config_is_the_resolved_config_as_a_dict():
    engine = _engine(zero_optimization={"stage": 2}, bf16={"enabled": True})
    assert engine.config["zero_optimization"]["stage"] == 2  # the Trainer reads it like this
    assert engine.config["train_micro_batch_size_per_gpu"] == 2  # "auto"-style values arrive resolved
    assert (engine.bfloat16_enabled(), engine.fp16_enabled()) == (True, False)
    assert engine.zero_gather_16bit_weights_on_model_save() is False


def test_unknown_engine_attributes_are_the_modules():
    model = _model()
    model.greeting = "hello"
    model.generate = lambda: "tokens"
    engine = _engine(model)
    assert engine.greeting == "hello" and engine.generate() == "tokens"  # as engine.generate(...) with HF models
    with pytest.raises(AttributeError):
        engine.no_such_attribute


def test_the_caller_can_decide_where_an_accumulation_ends():
    # Accelerate counts accumulation itself and tells the engine at every backward
    engine = _engine(train_batch_size=8, train_micro_batch_size_per_gpu=2)
    assert engine.gradient_accumulation_steps() == 4
    for boundary in (False, True, True):
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
        assert engine.was_step_applied() is boundary
    assert engine.global_steps == 2


def test_backward_without_scaling_by_accumulation_steps():
    # the HF Trainer divides the loss by the accumulation steps itself and passes scale_wrt_gas=False
    grads = []
    for scale_wrt_gas in (True, False):
        engine = _engine(train_batch_size=8, train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 0})
        engine.backward(engine(torch.ones(2, 4)).pow(2).mean(), scale_wrt_gas=scale_wrt_gas)
        grads.append(engine.flat_params[0].ensure_grad_full().clone())
    torch.testing.assert_close(grads[1], grads[0] * 4)


def test_load_checkpoint_of_an_empty_folder_returns_none_none(tmp_path):
    assert _engine().load_checkpoint(tmp_path) == (None, None)  # the Trainer starts fresh on this


def test_save_checkpoint_names_tags_and_writes_latest_and_the_converter_as_deepspeed(tmp_path):
    engine = _engine()
    _train(engine, 2)
    path = engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert path.endswith("global_step2") and (tmp_path / "latest").read_text().strip() == "global_step2"
    assert (tmp_path / "zero_to_fp32.py").is_file()


def test_destroy_removes_the_engines_hooks_from_the_module():
    model = _model()
    engine = _engine(model, zero_optimization={"stage": 2})
    engine.destroy()
    model(torch.randn(2, 4)).sum().backward()  # plain autograd again: gradients land on the parameters
    assert all(p.grad is not None for p in model.parameters())
