"""engine.load_checkpoint on folders real DeepSpeed wrote: zerotrain continues DeepSpeed's run as DeepSpeed did.

Each fixture (tests/fixtures/deepspeed_checkpoints, written on torch 2.13, 2 Gloo CPU ranks, by DeepSpeed
0.15.4 where its name starts with ds0.15_, by 0.19.8 otherwise; see write_fixtures.py) records DeepSpeed's
own next 3 losses after loading the checkpoint into
a fresh engine. zerotrain builds the same model and config, loads the same checkpoint, trains the same 3
batches and must give those losses. One 2-rank spawn runs every case; one 1-rank spawn the resharding case.
The universal_* fixtures (DeepSpeed's ds_to_universal.py output) must give the continuation DeepSpeed
recorded for the checkpoint they were converted from.

Tolerances (relative, on the mean loss over ranks; measured with this file): fp32 1e-6, measured 0 (bitwise).
16-bit masters, moments and loss scale are fp32 and restored exactly, but forward and backward run in
bf16/fp16: bf16 5e-4, measured 0 at stages 0-2 and 2.4e-4 at stage 3 (its gathered 16-bit weights
sum in another order); fp16 2e-3, measured 0 except 1.0e-3 on the third step, the first after DeepSpeed's
loss scale grows (zerotrain trained from scratch differs from DeepSpeed alike after its own growth
step). Moments zeroed on load move the losses by 1.2e-2 to 1.4e-2 (second-to-third step), 24x and 7x
those tolerances. fp16 stage 0 is the exception: see STAGE0_FP16_RTOL.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import run_on_ranks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())
FP32_RTOL = 1e-6
HALF_RTOL = {"bf16": 5e-4, "fp16": 2e-3}
# zerotrain's fp16 stage 0 already trains apart from DeepSpeed's FP16_Optimizer (3e-4 after one step from
# scratch), so its continuation differs as much as zeroed moments would: its moments are checked directly.
STAGE0_FP16_RTOL = 2e-2
MOMENTS = ("exp_avg", "exp_avg_sq")
# DeepSpeed's stage-0 optimizer numbers parameters in param-group order (write_fixtures.param_groups).
STAGE0_OPTIMIZER_ORDER = ["embed.weight", "fc1.weight", "proj.weight", "fc1.bias", "frozen.bias", "proj.bias"]
# Resharded: DeepSpeed's stage-2, 2-rank checkpoint resumed at another stage and world size.
RESHARD_FROM = "stage2_fp32"
# A universal checkpoint (converted from stage3_fp32) resumed at ZeRO-1 on one rank.
UNIVERSAL_RESHARD_FROM = "universal_stage3_fp32"


def _fixture(case: str) -> dict:
    return json.loads((FIXTURES / case / "fixture.json").read_text())


def _zerotrain_config(case: str) -> dict:
    """The DeepSpeed run's config as it is (elastic_checkpoint included: accepted, a no-op in zerotrain)."""
    return _fixture(case)["ds_config"]


def _write_fixtures():
    """write_fixtures.py (TinyModel, batch, param_groups): imported by path, it needs no DeepSpeed."""
    spec = importlib.util.spec_from_file_location("write_fixtures", FIXTURES / "write_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume(config: dict, checkpoint: Path, world: int, rank: int, **load_kwargs) -> dict:
    """A fresh engine (other initial weights) loads `checkpoint` and trains the fixture's next steps."""
    import torch
    import torch.distributed as dist

    import zerotrain

    fixtures = _write_fixtures()
    torch.manual_seed(fixtures.SEED + 1)
    model = fixtures.TinyModel()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=fixtures.param_groups(model), config=config)
    path, client_state = engine.load_checkpoint(str(checkpoint), **load_kwargs)
    out = {"path": path, "client_state": {k: client_state.get(k) for k in fixtures.CLIENT_STATE},
           "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
           "loss_scale": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None}
    if engine.zero_optimization_stage() == 0:  # whole parameters on every rank: their moments as loaded
        inner = engine.optimizer.optimizer
        out["moments"] = {
            name: {kind: inner.state[fp.master][kind][offset : offset + numel].clone() for kind in MOMENTS}
            for fp in engine.flat_params for name, offset, numel in zip(fp.names, fp.offsets, fp.numels)
        }
    losses = []
    per_rank = 2 // world  # the fixtures' global batch: 2 ranks' micro batches
    for step in range(fixtures.STEPS + 1, 2 * fixtures.STEPS + 1):
        pairs = [fixtures.batch(step, rank * per_rank + r) for r in range(per_rank)]
        inputs, targets = (torch.cat([p[i] for p in pairs]) for i in (0, 1))
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        gathered = [None] * world
        dist.all_gather_object(gathered, float(loss.detach().float()))
        losses.append(sum(gathered) / world)
    out["losses"] = losses
    return out


def _all_cases_on_two_ranks(scratch: str) -> dict:
    import os

    import torch.distributed as dist

    from zerotrain.checkpoint.errors import CheckpointError

    rank = int(os.environ["RANK"])  # the process group starts with the first engine
    out = {case: _resume(_zerotrain_config(case), FIXTURES / case / "checkpoint", 2, rank) for case in CASES}
    stage3 = dict(_fixture(RESHARD_FROM)["ds_config"], zero_optimization={"stage": 3})
    out["reshard_stage3"] = _resume(stage3, FIXTURES / RESHARD_FROM / "checkpoint", 2, rank)
    broken = Path(scratch) / "checkpoint"
    if rank == 0:  # a tag folder missing rank 1's optimizer file
        shutil.copytree(FIXTURES / RESHARD_FROM / "checkpoint", broken)
        (broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    dist.barrier()
    config = _fixture(RESHARD_FROM)["ds_config"]
    out["module_only"] = _resume(config, FIXTURES / RESHARD_FROM / "checkpoint", 2, rank, load_module_only=True)
    out["no_optimizer"] = _resume(config, FIXTURES / RESHARD_FROM / "checkpoint", 2, rank,
                                  load_optimizer_states=False)
    try:
        _resume(_fixture(RESHARD_FROM)["ds_config"], broken, 2, rank)
        out["missing_rank"] = None
    except CheckpointError as error:
        out["missing_rank"] = str(error)
    return out


def _stage1_on_one_rank(wrapped: str) -> dict:
    config = dict(_fixture(RESHARD_FROM)["ds_config"], zero_optimization={"stage": 1}, train_micro_batch_size_per_gpu=4)
    return {"resharded": _resume(config, FIXTURES / RESHARD_FROM / "checkpoint", 1, 0),
            "wrapped": _resume(config, Path(wrapped), 1, 0, strip_prefix="module."),
            "universal": _resume(config, FIXTURES / UNIVERSAL_RESHARD_FROM / "checkpoint", 1, 0)}


@pytest.fixture(scope="module")
def resumed() -> dict:
    from deepspeed_wrapped_copy import wrapped_copy

    with tempfile.TemporaryDirectory() as scratch:
        results = run_on_ranks(2, _all_cases_on_two_ranks, scratch, timeout=600)
        wrapped = wrapped_copy(FIXTURES / RESHARD_FROM / "checkpoint", Path(scratch) / "wrapped", "module.")
        one_rank = run_on_ranks(1, _stage1_on_one_rank, str(wrapped))[0]
    return {"ranks": results, "one_rank": one_rank["resharded"], "wrapped": one_rank["wrapped"],
            "universal_one_rank": one_rank["universal"]}


def _deepspeed_losses(case: str) -> list[float]:
    return [sum(step) / len(step) for step in _fixture(case)["losses_after_load"]]


def _worst_relative(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_resumed_losses_equal_deepspeeds_own_continuation(resumed, case):
    precision = _fixture(case)["case"]["precision"]
    tolerance = FP32_RTOL if precision == "fp32" else HALF_RTOL[precision]
    tolerance = STAGE0_FP16_RTOL if case == "stage0_fp16" else tolerance
    ours, theirs = resumed["ranks"][0][case]["losses"], _deepspeed_losses(case)
    steps = [f"{abs(a - b) / abs(b):.2g}" for a, b in zip(ours, theirs)]
    worst = _worst_relative(ours, theirs)
    assert worst <= tolerance, f"{case}: relative loss differences {steps}, worst {worst:.3g} > {tolerance}"


@pytest.mark.slow
def test_client_state_and_counters_are_restored(resumed):
    for case in CASES:
        fixture, got = _fixture(case), resumed["ranks"][1][case]
        assert got["client_state"] == fixture["client_state_loaded"], case
        assert got["counters"] == (3, 12, 0), case  # 3 steps of 2 ranks x 2 samples, none skipped
        assert Path(got["path"]).name == "global_step3" + ("_universal" if "universal" in fixture else ""), case
        if fixture["case"]["precision"] == "fp16":  # DeepSpeed's scale after 3 clean steps of window 2
            assert got["loss_scale"]["cur_scale"] == 512.0 and got["loss_scale"]["cur_iter"] == 3, case


@pytest.mark.slow
def test_a_deepspeed_checkpoint_resumes_at_another_stage_and_world_size(resumed):
    theirs = _deepspeed_losses(RESHARD_FROM)
    assert _worst_relative(resumed["ranks"][0]["reshard_stage3"]["losses"], theirs) <= FP32_RTOL
    assert _worst_relative(resumed["one_rank"]["losses"], theirs) <= FP32_RTOL


@pytest.mark.slow
def test_a_universal_checkpoint_resumes_at_another_stage_and_world_size(resumed):
    """ds_to_universal.py's output of a 2-rank ZeRO-3 run, resumed at ZeRO-1 on one rank (fp32: 1e-6)."""
    theirs = _deepspeed_losses(UNIVERSAL_RESHARD_FROM)
    assert _worst_relative(resumed["universal_one_rank"]["losses"], theirs) <= FP32_RTOL
    assert resumed["universal_one_rank"]["counters"] == (3, 12, 0)


@pytest.mark.slow
def test_a_checkpoint_of_a_wrapped_model_resumes_with_strip_prefix(resumed):
    """Saved as DeepSpeed names a DDP-wrapped model's parameters (`module.fc1.weight`): loaded with
    strip_prefix="module.", it continues as the unwrapped checkpoint does (fp32, 1 rank: 1e-6)."""
    wrapped = resumed["wrapped"]
    assert _worst_relative(wrapped["losses"], _deepspeed_losses(RESHARD_FROM)) <= FP32_RTOL
    assert wrapped["counters"] == (3, 12, 0)


@pytest.mark.slow
def test_a_missing_rank_file_is_refused_naming_the_folder(resumed):
    for rank in resumed["ranks"]:
        message = rank["missing_rank"]
        assert message is not None, "a tag folder without rank 1's optimizer file was loaded"
        assert "global_step3" in message and "copy the whole tag folder" in message


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("stage0_")])
def test_stage0_moments_are_deepspeeds_saved_ones(resumed, case):
    """Stage 0 saves torch's state dict without names; each moment must land on its own parameter."""
    from zerotrain.checkpoint.deepspeed_pickle import load_deepspeed_file

    optimizer = load_deepspeed_file(FIXTURES / case / "checkpoint" / "global_step3" / "mp_rank_00_model_states.pt")["optimizer"]
    state = optimizer.get("optimizer_state_dict", optimizer)["state"]
    loaded = resumed["ranks"][0][case]["moments"]
    for index, name in enumerate(STAGE0_OPTIMIZER_ORDER):
        for kind in MOMENTS:
            assert loaded[name][kind].equal(state[index][kind].reshape(-1)), (name, kind)


@pytest.mark.slow
def test_load_module_only_and_load_optimizer_states_false_are_honoured(resumed):
    theirs = _deepspeed_losses(RESHARD_FROM)
    module_only, no_optimizer = resumed["ranks"][0]["module_only"], resumed["ranks"][0]["no_optimizer"]
    for run in (module_only, no_optimizer):  # the weights are DeepSpeed's: the first loss is its first loss
        assert run["losses"][0] == theirs[0]
        assert _worst_relative(run["losses"], theirs) > 1e-3  # fresh moments (and step count, LR) train apart
    assert module_only["counters"] == (0, 0, 0)
    assert no_optimizer["counters"] == (3, 12, 0)


def test_elastic_checkpoint_moments_land_on_their_parameters():
    """DeepSpeed 0.15.4 with elastic_checkpoint saves, per rank, a list of each param group's moments (no
    torch state dict): rank R's piece of group G is that rank's stretch of the group's flat partition."""
    from types import SimpleNamespace

    import torch

    from zerotrain.checkpoint.deepspeed_pickle import load_deepspeed_file
    from zerotrain.checkpoint.deepspeed_resume import DeepSpeedResumeReader

    tag = FIXTURES / "ds0.15_stage2_fp32_elastic" / "checkpoint" / "global_step3"
    engine = SimpleNamespace(gradient_accumulation_steps=lambda: 1, train_batch_size=lambda: 4, loss_scaler=None)
    reader = DeepSpeedResumeReader(tag, engine)
    ranks = [load_deepspeed_file(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
             for r in (0, 1)]
    for kind in MOMENTS:
        saved = [torch.cat([rank["base_optimizer_state"][g][kind] for rank in ranks]) for g in (0, 1)]
        for g, names in enumerate((STAGE0_OPTIMIZER_ORDER[:3], STAGE0_OPTIMIZER_ORDER[3:])):  # param group order
            offset = 0
            for name in names:  # DeepSpeed 0.15 puts no alignment padding between parameters
                numel = reader.numel(name)
                assert reader.read_range(kind, name, 0, numel).equal(saved[g][offset : offset + numel]), (kind, name)
                offset += numel
    assert reader.meta["group_scalars"] == [{"step": {"value": 3.0, "dtype": "float32"}}] * 2
    assert reader.meta["param_groups"] == [{}, {}]  # DeepSpeed restores no hyperparameters from this form



def test_strip_prefix_renames_every_entry_and_refuses_a_prefix_some_names_lack(tmp_path):
    from types import SimpleNamespace

    from deepspeed_wrapped_copy import wrapped_copy

    from zerotrain.checkpoint.deepspeed_resume import DeepSpeedResumeReader
    from zerotrain.checkpoint.errors import CheckpointError

    engine = SimpleNamespace(gradient_accumulation_steps=lambda: 1, train_batch_size=lambda: 4, loss_scaler=None)
    plain = DeepSpeedResumeReader(FIXTURES / RESHARD_FROM / "checkpoint" / "global_step3", engine)
    tag = wrapped_copy(FIXTURES / RESHARD_FROM / "checkpoint", tmp_path / "wrapped", "_orig_mod.") / "global_step3"
    assert set(DeepSpeedResumeReader(tag, engine).params) == {"_orig_mod." + n for n in plain.params}
    reader = DeepSpeedResumeReader(tag, engine, strip_prefix="_orig_mod.")
    assert reader.params == plain.params and reader.module_entries == plain.module_entries
    for name in plain.params:
        for kind in ("master",) + MOMENTS:
            assert reader.read_range(kind, name, 0, plain.numel(name)).equal(
                plain.read_range(kind, name, 0, plain.numel(name))), (kind, name)
    for name in plain.module_entries:
        assert reader.read_module(name).equal(plain.read_module(name)), name
    assert reader.meta == plain.meta
    with pytest.raises(CheckpointError, match=r"strip_prefix='module\.', but 9 of its 9 names do not start with it"):
        DeepSpeedResumeReader(tag, engine, strip_prefix="module.")
