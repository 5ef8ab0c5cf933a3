"""The reference configs users copy today (tests/fixtures/configs): each loads and resolves."""

from __future__ import annotations

import torch

from config_fixtures import CONFIGS, StubModel, error_of
from zerotrain.config import load_config, resolve_config


FULL_AUTO_VALUES = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer.params.lr": 1e-4,
    "scheduler.params.warmup_num_steps": 100,
    "scheduler.params.total_num_steps": 1000,
}


def test_reference_configs_are_all_covered():
    covered = {
        "accelerate-zero1-fp16.json", "guide-zero2-auto.jsonc", "guide-zero3-nvme.jsonc",
        "guide-zero3-offload.jsonc", "multinode-zero2-small.json",
    }
    assert {p.name for p in CONFIGS.glob("*.json*")} == covered


def test_reference_accelerate_zero1_fp16_resolves():
    cfg = load_config(CONFIGS / "accelerate-zero1-fp16.json")
    message = error_of(resolve_config, cfg, world_size=2)
    assert 'train_micro_batch_size_per_gpu is "auto"' in message and "set it in the config" in message
    cfg = resolve_config(cfg, world_size=2, auto_values={"train_micro_batch_size_per_gpu": 4})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)
    assert cfg.zero_stage == 1 and cfg.compute_dtype == torch.float16 and cfg.gradient_clipping == 1.0


def test_reference_guide_zero2_auto_resolves_with_cpu_offload():
    cfg = load_config(CONFIGS / "guide-zero2-auto.jsonc")
    assert cfg.zero_stage == 2 and cfg.fp16.enabled == "auto" and cfg.optimizer.params["lr"] == "auto"
    cfg = resolve_config(cfg, world_size=2, model=StubModel(), auto_values=FULL_AUTO_VALUES)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_reference_guide_zero2_auto_without_offload_resolves():
    cfg = load_config(CONFIGS / "guide-zero2-auto.jsonc")
    cfg.zero_optimization.offload_optimizer = None  # what the error message asks the user to do
    cfg = resolve_config(cfg, world_size=2, model=StubModel(hidden_size=64, dtype=torch.bfloat16),
                         auto_values=FULL_AUTO_VALUES)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.gradient_clipping == 0.0 and cfg.compute_dtype == torch.bfloat16
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64
    assert cfg.optimizer.params == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 100}


def test_reference_zero3_cpu_offload_resolves():
    cfg = resolve_config(load_config(CONFIGS / "guide-zero3-offload.jsonc"), world_size=2, model=StubModel(),
                         auto_values=FULL_AUTO_VALUES)
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 3 and zero.offload_param.device == "cpu" and zero.offload_optimizer.device == "cpu"


def test_reference_zero3_nvme_resolves():
    # Nothing in it is refused any more: parameters and optimizer state on NVMe are built.
    cfg = resolve_config(load_config(CONFIGS / "guide-zero3-nvme.jsonc"), world_size=2, model=StubModel(),
                         auto_values=FULL_AUTO_VALUES)
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 3 and cfg.compute_dtype == torch.bfloat16
    assert zero.offload_param.device == "nvme" and zero.offload_optimizer.device == "nvme"
    assert (zero.offload_param.buffer_count, zero.offload_param.buffer_size) == (5, 10**8)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 4)


def test_reference_zero3_offload_keeps_stage3_keys():
    zero = load_config(CONFIGS / "guide-zero3-offload.jsonc").zero_optimization
    assert zero.max_live_parameters == 1_000_000_000 and zero.sub_group_size == 10**12
    assert zero.prefetch_bucket_size == "auto" and zero.gather_16bit_weights_on_model_save is True
    nvme = load_config(CONFIGS / "guide-zero3-nvme.jsonc").zero_optimization
    assert str(nvme.offload_param.nvme_path) == "/local_nvme" and nvme.offload_param.max_in_cpu == 10**9


def test_reference_multinode_zero2_needs_total_num_steps():
    cfg = load_config(CONFIGS / "multinode-zero2-small.json")
    assert cfg.zero_optimization.offload_optimizer is None  # "cpu_offload": false
    message = error_of(resolve_config, cfg, world_size=16, auto_values={"train_micro_batch_size_per_gpu": 2})
    assert message == (
        'scheduler.params.total_num_steps is "auto" and zerotrain cannot infer it here: '
        "set a number, or let `zerotrain train` fill it"
    )
    cfg = resolve_config(cfg, world_size=16, auto_values=FULL_AUTO_VALUES)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 1)
    assert cfg.optimizer.params["betas"] == [0.9, 0.999]
    assert cfg.scheduler.params == {"total_num_steps": 1000, "warmup_max_lr": 0.0006, "warmup_num_steps": 4000}
