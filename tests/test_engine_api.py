"""DeepSpeed's initialize/engine API on a world of one (in this process)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.config import ConfigError
from zerotrain.comm.distributed import read_launch_env


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _config(**overrides) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
    }
    cfg.update(overrides)
    return cfg


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _train(engine, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        x, y = _batch(s)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_initialize_returns_engine_optimizer_dataloader_and_scheduler():
    data = torch.utils.data.TensorDataset(torch.randn(20, 8))
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}}
    engine, opt, loader, lr_sched = zerotrain.initialize(
        model=_model(), config=_config(scheduler=sched), training_data=data
    )
    assert opt is engine.optimizer and lr_sched is engine.lr_scheduler
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert loader.batch_size == 4 and len(next(iter(loader))[0]) == 4
    assert engine.zero_optimization_stage() == 1
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (4, 4, 1)
    before = engine.get_lr()[0]
    _train(engine, 2)
    assert engine.get_lr()[0] > before, "WarmupLR raises the lr each step"


def test_config_path_comes_from_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("// a comment, as DeepSpeed allows\n" + json.dumps(_config(gradient_accumulation_steps=2)))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = zerotrain.initialize(args=args, model=_model())
    assert engine.gradient_accumulation_steps() == 2 and engine.train_batch_size() == 8


def test_deepspeed_script_helpers_exist_under_the_same_names():
    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    zerotrain.init_distributed()  # idempotent, as deepspeed.init_distributed
    assert torch.distributed.is_initialized()


def test_counters_follow_accumulation_boundaries():
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(gradient_accumulation_steps=3))
    boundaries = []
    for s in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        x, y = _batch(s)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert (engine.micro_steps, engine.global_steps, engine.global_samples) == (6, 2, 24)


def test_client_torch_optimizer_is_rebuilt_with_its_class_and_hyperparameters():
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = _config()
    del cfg["optimizer"]
    engine, opt, _, _ = zerotrain.initialize(model=model, optimizer=client, config=cfg)
    assert type(opt.optimizer) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    losses = _train(engine, 5)
    for s in range(5):
        x, y = _batch(s)
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert losses[s] == pytest.approx(loss.item(), rel=1e-5)


def test_client_scheduler_drives_the_rebuilt_optimizer():
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5**step)
    cfg = _config()
    del cfg["optimizer"]
    engine, _, _, lr_sched = zerotrain.initialize(model=model, optimizer=client, lr_scheduler=sched, config=cfg)
    _train(engine, 3)
    assert engine.get_lr()[0] == pytest.approx(0.1 * 0.5**3)


def test_a_scheduler_left_on_the_users_optimizer_sets_the_rebuilt_optimizers_lr():
    # Accelerate keeps a torch scheduler on the user's optimizer and steps it itself (DeepSpeed steps that object)
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5**step)
    cfg = _config()
    del cfg["optimizer"]
    engine, _, _, _ = zerotrain.initialize(model=model, optimizer=client, config=cfg)
    for _ in range(3):
        _train(engine, 1)
        sched.step()
    assert engine.get_lr()[0] == pytest.approx(0.1 * 0.5**3)


def test_a_scheduler_factory_gets_the_torch_optimizer():
    # the HF Trainer hands its schedule over as a factory when the config has only an optimizer section
    engine, _, _, sched = zerotrain.initialize(
        model=_model(), lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step),
        config=_config(),
    )
    assert isinstance(sched.optimizer, torch.optim.Optimizer)
    _train(engine, 2)
    assert engine.get_lr()[0] == pytest.approx(_config()["optimizer"]["params"]["lr"] * 0.5**2)


def test_an_engine_without_optimizer_serves_forward_and_refuses_to_step():
    cfg = _config()
    del cfg["optimizer"]
    engine, *_ = zerotrain.initialize(model=_model(), config=cfg)  # as DeepSpeed: inference only
    x, y = _batch(0)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="no optimizer: this engine serves forward passes only"):
        engine.step()


def test_optimizer_in_config_and_argument_is_an_error():
    model = _model()
    with pytest.raises(ConfigError, match="use one of the two"):
        zerotrain.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config())


def test_global_grad_norm_is_the_unclipped_norm_of_the_whole_gradient():
    reference = _model()
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(gradient_clipping=0.01))
    x, y = _batch(0)
    nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    _train(engine, 1)
    assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_skips_the_update_and_the_scheduler(stage):
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"}}
    cfg = _config(
        fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1},
        scheduler=sched,
        zero_optimization={"stage": stage},
    )
    engine, *_ = zerotrain.initialize(model=_model(), config=cfg)
    before = [p.detach().clone() for p in engine.module.parameters()]
    lr_before = engine.get_lr()
    x, y = _batch(0)
    loss = nn.functional.mse_loss(engine(x).float(), y) * float("inf")
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.optimizer.cur_scale == 2**7, "the scale halves on overflow"
    assert engine.get_lr() == lr_before, "the scheduler does not step on a skipped update"
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    _train(engine, 1)  # a finite step afterwards updates the weights
    assert engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_no_sync_is_refused_at_stage_2_and_blocks_the_boundary_step_elsewhere():
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(zero_optimization={"stage": 2}))
    with pytest.raises(RuntimeError, match="not available at ZeRO stage 2"):
        with engine.no_sync():
            pass
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(zero_optimization={"stage": 0}))
    with pytest.raises(RuntimeError, match="inside no_sync"):
        with engine.no_sync():
            x, y = _batch(0)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 4, 0)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}, (5, 6, 1)),
        ({}, (0, 1, 0)),
    ],
    ids=["torchrun", "openmpi", "slurm", "no-launcher"],
)
def test_rank_and_world_come_from_any_launcher_environment(env, expected):
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == expected


def test_progress_with_wall_clock_breakdown_is_reported_every_steps_per_print(caplog):
    engine, *_ = zerotrain.initialize(
        model=_model(), config=_config(steps_per_print=2, wall_clock_breakdown=True)
    )
    logger = logging.getLogger("zerotrain")
    logger.addHandler(caplog.handler)
    try:
        _train(engine, 4)
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "zerotrain"]
    assert [line.split(" | ")[0] for line in lines] == ["step 2", "step 4"]
    assert all("forward" in line and "backward" in line and "grad norm" in line for line in lines)


def test_offload_param_below_stage_3_is_ignored_as_deepspeed_ignores_it_and_said(caplog):
    # DeepSpeed-Chat's --offload writes offload_param at every stage; DeepSpeed reads it at stage 3 only.
    plain = zerotrain.initialize(model=_model(), config=_config(zero_optimization={"stage": 2}))[0]
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        offload = {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
        engine = zerotrain.initialize(model=_model(), config=_config(zero_optimization=offload))[0]
    assert "offload_param has no effect at ZeRO stage 2" in caplog.text
    assert _train(engine, 3) == pytest.approx(_train(plain, 3), rel=1e-6)


def test_tput_timer_counts_epochs_and_samples_per_second():
    # DeepSpeed-Chat calls engine.tput_timer.update_epoch_count() after each epoch.
    engine = zerotrain.initialize(model=_model(), config=_config())[0]
    assert engine.tput_timer.avg_samples_per_sec() == 0.0
    _train(engine, 3)
    engine.tput_timer.update_epoch_count()
    assert engine.tput_timer.epoch_count == 1 and engine.tput_timer.avg_samples_per_sec() > 0
