"""DeepSpeed's `deepspeed.zero` API: the namespace right after `import zerotrain as deepspeed`,
and register_external_parameter at stage 3 on 2 ranks against plain torch on one process,
with what that run saves (save_16bit_model, the consolidated 16-bit state dict)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import zerotrain
from conftest import run_on_ranks
from zerotrain.zero import GatheredParameters, register_external_parameter, unregister_external_parameter


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


@pytest.mark.slow
def test_external_parameter_is_gathered_for_its_reader_at_stage_3_on_2_ranks(tied_two_ranks):
    ranks, _ = tied_two_ranks
    ref_losses, ref_params = _tied_reference()
    # Each rank's loss is over its half of the batch: their mean is the global batch's loss.
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5)
    for result in ranks:
        for name, ref in ref_params.items():
            torch.testing.assert_close(result["params"][name], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_global_rank_and_dp_world_size_on_2_ranks(tied_two_ranks):
    ranks, _ = tied_two_ranks
    assert [r["layout"] for r in ranks] == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_save_16bit_model_at_stage_3_with_the_gather_flag_saves_whole_weights(tied_two_ranks):
    ranks, save_dir = tied_two_ranks
    assert [r["saved"] for r in ranks] == [True, True]  # DeepSpeed returns True on every rank
    weights = torch.load(save_dir / "pytorch_model.bin", weights_only=True)
    for name, value in ranks[0]["params"].items():
        assert torch.equal(weights[name], value), name


@pytest.mark.slow
def test_consolidated_16bit_state_dict_is_whole_on_rank_0_and_none_elsewhere(tied_two_ranks):
    ranks, _ = tied_two_ranks
    assert ranks[1]["consolidated"] is None
    whole = ranks[0]["consolidated"]
    assert whole.keys() == ranks[0]["params"].keys()
    for name, value in ranks[0]["params"].items():
        assert torch.equal(whole[name], value), name


@pytest.mark.slow
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
