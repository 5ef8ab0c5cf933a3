"""DeepSpeed's engine and `deepspeed.zero` API, checked against values DeepSpeed itself gave.

The expected values were recorded by running DeepSpeed on CPU (DS_ACCELERATOR=cpu, one
process, torch 2.13.0) on the same model and configs as below: DeepSpeed 0.19.8 for the
engine accessors, DeepSpeed 0.19.2 for `warmup_num_steps: 0` (0.19.3 and later reject 0;
0.19.2 and earlier accept it and warm up over 2 steps). DeepSpeed is not a test dependency:
the values are written here.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

import zerotrain
from conftest import run_on_ranks
from zerotrain.zero import GatheredParameters, register_external_parameter, unregister_external_parameter

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


# --- import zerotrain as deepspeed --------------------------------------------------------------


def test_zero_namespace_is_reachable_right_after_import_and_loaded_lazily():
    code = (
        "import sys\n"
        "import zerotrain as deepspeed\n"
        "assert 'zerotrain.zero' not in sys.modules, 'import zerotrain must stay light'\n"
        "print(deepspeed.zero.Init.__name__, deepspeed.zero.register_external_parameter.__name__,\n"
        "      deepspeed.zero.GatheredParameters.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Init", "register_external_parameter", "GatheredParameters"]


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


# --- register_external_parameter ----------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.tanh(self.proj(x))
        return x if extra is None else nn.functional.linear(x, extra)  # `extra`: another layer's weight


class _TiedNet(nn.Module):
    """Layer 2 reads layer 1's weight; the output projection is tied to layer 0's weight."""

    def __init__(self, register: tuple[str, ...] = ("layer", "root")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.out_bias = nn.Parameter(torch.linspace(-0.1, 0.1, 8))
        if "layer" in register:  # read by another layer unit
            register_external_parameter(self.layers[2], self.layers[1].proj.weight)
        if "root" in register:  # read by the root, after its own unit has run
            register_external_parameter(self, self.layers[0].proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        x = self.layers[2](x, extra=self.layers[1].proj.weight)
        return x @ self.layers[0].proj.weight + self.out_bias


# Every unit freed after its forward and nothing prefetched or kept whole, so a parameter read
# outside its own unit is whole only if the registration gathers it.
STAGE3_EVERY_UNIT_FREED = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_gather_16bit_weights_on_model_save": True,
}
SGD = {"type": "SGD", "params": {"lr": 0.1}}
STEPS, GLOBAL_BATCH = 3, 4


def _tied_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)


def _tied_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, plain torch, the whole global batch."""
    model = _TiedNet(register=())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _tied_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tied_on_ranks(save_dir: str) -> dict:
    import torch.distributed as dist

    engine, *_ = zerotrain.initialize(
        model=_TiedNet(),
        config={"train_batch_size": GLOBAL_BATCH, "optimizer": SGD, "zero_optimization": STAGE3_EVERY_UNIT_FREED},
    )
    rank, micro = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for step in range(STEPS):
        x, y = (t[rank * micro : (rank + 1) * micro] for t in _tied_batch(step))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    saved = engine.save_16bit_model(save_dir, "pytorch_model.bin")
    consolidated = engine._zero3_consolidated_16bit_state_dict()  # what Accelerate and the HF Trainer call
    return {"losses": losses, "params": params, "saved": saved, "layout": (engine.global_rank, engine.dp_world_size),
            "consolidated": consolidated}


@pytest.fixture(scope="module")
def tied_two_ranks(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("tied")
    return run_on_ranks(2, _tied_on_ranks, str(save_dir)), save_dir


def test_external_parameter_is_gathered_for_its_reader_at_stage_3_on_2_ranks(tied_two_ranks):
    ranks, _ = tied_two_ranks
    ref_losses, ref_params = _tied_reference()
    # Each rank's loss is over its half of the batch: their mean is the global batch's loss.
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5)
    for result in ranks:
        for name, ref in ref_params.items():
            torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6)


def test_global_rank_and_dp_world_size_on_2_ranks(tied_two_ranks):
    ranks, _ = tied_two_ranks
    assert [r["layout"] for r in ranks] == [(0, 2), (1, 2)]


def test_save_16bit_model_at_stage_3_with_the_gather_flag_saves_whole_weights(tied_two_ranks):
    ranks, save_dir = tied_two_ranks
    assert [r["saved"] for r in ranks] == [True, True]  # DeepSpeed returns True on every rank
    weights = torch.load(save_dir / "pytorch_model.bin", weights_only=True)
    for name, value in ranks[0]["params"].items():
        assert torch.equal(weights[name], value), name


def test_consolidated_16bit_state_dict_is_whole_on_rank_0_and_none_elsewhere(tied_two_ranks):
    ranks, _ = tied_two_ranks
    assert ranks[1]["consolidated"] is None
    whole = ranks[0]["consolidated"]
    assert whole.keys() == ranks[0]["params"].keys()
    for name, value in ranks[0]["params"].items():
        assert torch.equal(whole[name], value), name


@pytest.mark.parametrize("registered", [("layer",), ("root",)], ids=["root-read-missing", "layer-read-missing"])
def test_without_registration_a_foreign_weight_is_empty_at_stage_3(registered):
    engine, *_ = zerotrain.initialize(
        model=_TiedNet(register=registered),
        config={"train_batch_size": GLOBAL_BATCH, "optimizer": SGD, "zero_optimization": STAGE3_EVERY_UNIT_FREED},
    )
    with pytest.raises(RuntimeError):
        engine(_tied_batch(0)[0])


def test_registration_is_a_no_op_below_stage_3():
    x, y = _tied_batch(0)
    ref_loss = nn.functional.mse_loss(_TiedNet(register=())(x), y).item()
    engine, *_ = zerotrain.initialize(
        model=_TiedNet(),
        config={"train_batch_size": GLOBAL_BATCH, "optimizer": SGD, "zero_optimization": {"stage": 2}},
    )
    assert nn.functional.mse_loss(engine(x), y).item() == pytest.approx(ref_loss, rel=1e-6)


def test_register_and_unregister_raise_deepspeeds_errors():
    module, param = nn.Linear(2, 2), nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        register_external_parameter(module, torch.zeros(2))
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        unregister_external_parameter(module, param)
    register_external_parameter(module, param)
    unregister_external_parameter(module, param)
    assert module._external_params == {}


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
