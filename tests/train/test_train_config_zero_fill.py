"""Filling the DeepSpeed section (zero) of `zerotrain train`'s config from the training settings:
"auto" values, optimizer and schedule, precision, and values set on both sides that must agree."""

from __future__ import annotations

import pytest
import torch

from train_config_fixtures import TINY, engine, error_of, with_model, write
from zerotrain.train.config import TrainConfig
from zerotrain.train.config_files import load_train_config
from zerotrain.train.zero_fill import resolve_precision


# --------------------------------------------------------------------------- #
# filling "auto" from training


def test_every_auto_is_filled_from_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 4, gradient_accumulation_steps: 3, lr: 2.0e-3, min_lr: 2.0e-4,
                   betas: [0.8, 0.9], eps: 1.0e-6, weight_decay: 0.1, warmup_steps: 5, grad_clip: 0.7,
                   precision: fp32}
        zero:
          train_batch_size: auto
          train_micro_batch_size_per_gpu: auto
          gradient_accumulation_steps: auto
          gradient_clipping: auto
          fp16: {enabled: auto}
          bf16: {enabled: auto}
          optimizer: {type: AdamW, params: {lr: auto, betas: auto, eps: auto, weight_decay: auto}}
          scheduler: {type: WarmupDecayLR, params: {total_num_steps: auto, warmup_num_steps: auto,
                                                    warmup_min_lr: auto, warmup_max_lr: auto}}
          zero_optimization: {stage: 2, reduce_bucket_size: auto}
        """))
    resolved, _ = engine(load_train_config(run, ["--training.lr_schedule", "linear"]), world_size=2, total_steps=50)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (24, 4, 3)
    assert resolved.gradient_clipping == 0.7
    assert resolved.fp16.enabled is False and resolved.bf16.enabled is False
    assert resolved.optimizer.params == {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}
    assert resolved.scheduler.params == {
        "total_num_steps": 50, "warmup_num_steps": 5, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3}
    assert resolved.zero_optimization.reduce_bucket_size == 32 * 32  # from the model's hidden size


@pytest.mark.parametrize(
    ("schedule", "kind", "expected"),
    [
        ("cosine", "WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 4, "warmup_type": "linear",
                                      "warmup_min_ratio": 0.0, "cos_min_ratio": pytest.approx(0.1)}),
        ("linear", "WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 4, "warmup_type": "linear",
                                     "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}),
        ("constant", "WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_min_lr": 0.0,
                                  "warmup_max_lr": 1e-3}),
    ],
)
def test_optimizer_and_schedule_are_built_from_training_when_zero_has_none(schedule, kind, expected):
    cfg = load_train_config(None, ["--training.lr_schedule", schedule, "--training.lr", "1e-3",
                                   "--training.min_lr", "1e-4", "--training.warmup_steps", "4"])
    resolved, notes = engine(cfg, total_steps=40)
    assert resolved.optimizer.type == "AdamW"
    assert resolved.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert resolved.scheduler.type == kind and resolved.scheduler.params == expected
    assert resolved.train_micro_batch_size_per_gpu == cfg.training.micro_batch_size
    assert resolved.gradient_clipping == cfg.training.grad_clip
    assert any("min_lr" in note for note in notes) == (schedule == "linear")


def test_no_warmup_starts_cosine_at_the_full_lr():
    resolved, _ = engine(load_train_config(None, ["--training.warmup_steps", "0"]), total_steps=40)
    assert resolved.scheduler.params["warmup_min_ratio"] == 1.0 and resolved.scheduler.params["warmup_num_steps"] == 1


def test_keys_a_user_optimizer_leaves_out_come_from_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {lr: 0.01}
        zero: {optimizer: {type: Adam, params: {eps: 1.0e-6}}, scheduler: {type: WarmupLR, params: {}}}
        """))
    resolved, _ = engine(load_train_config(run))
    assert resolved.optimizer.params == {"eps": 1e-6, "lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.0}
    assert resolved.scheduler.params == {"warmup_num_steps": 1, "warmup_max_lr": 0.01}


def test_precision_auto_follows_the_device(monkeypatch):
    assert resolve_precision("auto", "cpu") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cuda", {"bf16": {"enabled": False}}) == "fp32"
    assert resolve_precision("fp16", "cuda") == "fp16"


# --------------------------------------------------------------------------- #
# values set on both sides


def test_values_set_both_ways_that_disagree_are_all_listed(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 8, lr: 3.0e-4, betas: [0.9, 0.95], grad_clip: 1.0, precision: bf16,
                   warmup_steps: 10, lr_schedule: cosine}
        zero:
          train_micro_batch_size_per_gpu: 4
          gradient_clipping: 0.5
          bf16: {enabled: false}
          optimizer: {type: AdamW, params: {lr: 1.0e-4, betas: [0.9, 0.999]}}
          scheduler: {type: WarmupLR, params: {warmup_num_steps: 100}}
        """))
    message = error_of(load_train_config, run)
    assert f"the DeepSpeed section (zero) and the training section disagree in {run}" in message
    for line in (
        "zero.train_micro_batch_size_per_gpu = 4 but training.micro_batch_size = 8",
        "zero.gradient_clipping = 0.5 but training.grad_clip = 1.0",
        "zero.optimizer.params.lr = 0.0001 but training.lr = 0.0003",
        "zero.optimizer.params.betas = [0.9, 0.999] but training.betas = [0.9, 0.95]",
        "zero.scheduler.params.warmup_num_steps = 100 but training.warmup_steps = 10",
        'zero.bf16.enabled = false but training.precision = "bf16"',
        'zero.scheduler.type = "WarmupLR" but training.lr_schedule = "cosine" (which is WarmupCosineLR)',
    ):
        assert f"  - {line}" in message
    assert 'write "auto" in zero' in message


def test_values_set_both_ways_that_agree_are_fine(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {micro_batch_size: 4, lr: 1.0e-4, betas: [0.9, 0.999], grad_clip: 0.5, max_steps: 30}
        zero:
          train_micro_batch_size_per_gpu: 4
          train_batch_size: 8
          gradient_clipping: 0.5
          optimizer: {type: AdamW, params: {lr: 0.0001, betas: [0.9, 0.999]}}
          scheduler: {type: WarmupCosineLR, params: {total_num_steps: 30}}
        """))
    cfg = load_train_config(run)
    assert cfg.notes == []
    resolved, _ = engine(cfg, world_size=2, total_steps=30)
    assert resolved.train_batch_size == 8 and resolved.optimizer.params["lr"] == 1e-4


def test_values_set_only_in_zero_are_adopted_by_training(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          train_micro_batch_size_per_gpu: 4
          gradient_accumulation_steps: 2
          gradient_clipping: 0.0
          fp16: {enabled: true}
          optimizer: {type: AdamW, params: {lr: 1.0e-4, betas: [0.9, 0.999], weight_decay: 0.1}}
          scheduler: {type: WarmupDecayLR, params: {total_num_steps: 77, warmup_num_steps: 7}}
        """))
    cfg = load_train_config(run)
    t = cfg.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.grad_clip) == (4, 2, 0.0)
    assert (t.lr, t.betas, t.weight_decay, t.eps) == (1e-4, (0.9, 0.999), 0.1, 1e-8)
    assert (t.max_steps, t.warmup_steps, t.lr_schedule, t.precision) == (77, 7, "linear", "fp16")
    assert "training.micro_batch_size = 4, taken from zero.train_micro_batch_size_per_gpu" in "\n".join(cfg.notes)
    resolved, notes = engine(cfg, world_size=2, total_steps=t.max_steps)
    assert resolved.train_batch_size == 16 and resolved.fp16.enabled is True
    assert resolved.scheduler.params["warmup_max_lr"] == 1e-4 and notes == cfg.notes


def test_zero_flags_win_over_the_built_in_defaults_but_not_over_training_flags(tmp_path, monkeypatch):
    write(tmp_path / "ds.json", '{"zero_optimization": {"stage": 1}, // comment\n "train_micro_batch_size_per_gpu": 2}')
    monkeypatch.chdir(tmp_path)  # --zero PATH is relative to the working directory
    cfg = load_train_config(None, ["--model.path", "d", "--zero=ds.json", "--zero.gradient_clipping", "0.3"])
    assert (cfg.model.path, cfg.model.architecture) == ("d", None)
    assert cfg.zero == {
        "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.3}
    assert (cfg.training.micro_batch_size, cfg.training.grad_clip) == (2, 0.3)
    default = load_train_config(None).training  # the default's other values are kept
    assert cfg.training.model_dump(exclude={"micro_batch_size", "grad_clip"}) == default.model_dump(
        exclude={"micro_batch_size", "grad_clip"})
    assert cfg.training.model_fields_set == {"micro_batch_size", "grad_clip"}
    message = error_of(load_train_config, None, ["--zero.gradient_clipping", "0.3", "--training.grad_clip", "1"])
    assert "zero.gradient_clipping = 0.3 but training.grad_clip = 1.0" in message


def test_two_zero_keys_for_one_training_setting_must_agree(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          optimizer: {type: AdamW, params: {lr: 1.0e-4}}
          scheduler: {type: WarmupLR, params: {warmup_max_lr: 2.0e-4}}
        """))
    message = error_of(load_train_config, run)
    assert "zero.scheduler.params.warmup_max_lr = 0.0002 but zero.optimizer.params.lr = 0.0001" in message


def test_train_batch_size_is_checked_against_the_world_size(tmp_path):
    run = write(tmp_path / "run.yaml", TINY + "training: {micro_batch_size: 4}\nzero: {train_batch_size: 16}\n")
    cfg = load_train_config(run)
    assert engine(cfg, world_size=4)[0].train_batch_size == 16
    message = error_of(engine, cfg, world_size=2)
    assert "zero.train_batch_size = 16 but training.micro_batch_size 4 × " in message and "world size 2 = 8" in message


def test_total_steps_from_epochs_must_match_an_explicit_total_num_steps(tmp_path):
    run = write(tmp_path / "run.yaml", with_model("""\
        training: {epochs: 2}
        zero: {scheduler: {type: WarmupCosineLR, params: {total_num_steps: 100}}}
        """))
    cfg = load_train_config(run)
    assert engine(cfg, total_steps=100)[0].scheduler.params["total_num_steps"] == 100
    message = error_of(engine, cfg, total_steps=60)
    assert "zero.scheduler.params.total_num_steps = 100 but training runs 60 steps (training.epochs = 2.0)" in message


def test_a_config_built_in_code_is_checked_too():
    cfg = TrainConfig(model={"architecture": "llama"}, training={"lr": 0.1}, zero={"optimizer": {
        "type": "AdamW", "params": {"lr": 0.2}}})
    assert "zero.optimizer.params.lr = 0.2 but training.lr = 0.1" in error_of(engine, cfg)


def test_deepspeed_activation_checkpointing_turns_on_the_models_gradient_checkpointing(tmp_path):
    from zerotrain.train.zero_fill import wants_gradient_checkpointing

    run = write(tmp_path / "run.yaml", with_model("""\
        zero:
          zero_optimization: {stage: 2}
          activation_checkpointing: {partition_activations: true, cpu_checkpointing: true}
        """))
    cfg = load_train_config(run)
    assert wants_gradient_checkpointing(cfg) and not cfg.training.gradient_checkpointing
    resolved, notes = engine(cfg, world_size=1, total_steps=10)  # not refused as an unbuilt feature
    assert any("activation_checkpointing" in n and "gradient checkpointing" in n for n in notes)
    assert not wants_gradient_checkpointing(load_train_config(None))
