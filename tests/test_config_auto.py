"""Resolving a loaded config: the batch-size arithmetic and the rules that fill each "auto" value."""

from __future__ import annotations

import pytest
import torch

from config_fixtures import CONFIGS, StubModel, error_of, resolve
from zerotrain.config import load_config, resolve_batch_sizes, resolve_config


# --------------------------------------------------------------------------- #
# batch arithmetic


@pytest.mark.parametrize(
    "world, train, micro, accum, ok",
    [(2, 32, 16, 1, True), (2, 32, 8, 2, True), (2, 33, 17, 2, False), (2, 32, 18, 1, False)],
)
def test_batch_table(world, train, micro, accum, ok):
    if ok:
        assert resolve_batch_sizes(train, micro, accum, world) == (train, micro, accum)
    else:
        message = error_of(resolve_batch_sizes, train, micro, accum, world)
        assert f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro}" in message
        assert f"gradient_accumulation_steps {accum} × world size {world} = {micro * accum * world}" in message


def test_batch_mismatch_message_shows_the_product():
    assert "train_batch_size 33 != train_micro_batch_size_per_gpu 17 × gradient_accumulation_steps 2 × " \
        "world size 2 = 68" in error_of(resolve_batch_sizes, 33, 17, 2, 2)


@pytest.mark.parametrize(
    "given, expected",
    [
        ((32, 8, None), (32, 8, 2)),  # train + micro -> accumulation
        ((32, None, 4), (32, 4, 4)),  # train + accumulation -> micro
        ((None, 4, 3), (24, 4, 3)),  # micro + accumulation -> train
        ((32, None, None), (32, 16, 1)),  # only train
        ((None, 4, None), (8, 4, 1)),  # only micro
    ],
)
def test_batch_inference(given, expected):
    assert resolve_batch_sizes(*given, world_size=2) == expected


def test_batch_inference_that_does_not_divide_is_an_error():
    assert "train_batch_size 33 !=" in error_of(resolve_batch_sizes, 33, 16, None, 2)
    assert "must be positive" in error_of(resolve_batch_sizes, 8, 16, None, 2)


def test_batch_with_neither_train_nor_micro_is_an_error():
    assert "train_micro_batch_size_per_gpu" in error_of(resolve_batch_sizes, None, None, 4, 2)


# --------------------------------------------------------------------------- #
# "auto" rules


def test_auto_batch_keys_take_auto_values_then_batch_arithmetic():
    data = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    cfg = resolve(data, auto_values={"train_micro_batch_size_per_gpu": 4})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)
    cfg = resolve(data, auto_values={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (24, 3)


def test_auto_accumulation_is_inferred_from_train_and_micro():
    cfg = resolve({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"})
    assert cfg.gradient_accumulation_steps == 4


def test_auto_train_and_micro_without_values_name_micro():
    message = error_of(resolve, {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert 'train_micro_batch_size_per_gpu is "auto"' in message and "set it in the config" in message


def test_auto_gradient_clipping_means_no_clipping():
    assert resolve({"train_batch_size": 8, "gradient_clipping": "auto"}).gradient_clipping == 0.0
    cfg = resolve({"train_batch_size": 8, "gradient_clipping": "auto"}, auto_values={"gradient_clipping": 1.0})
    assert cfg.gradient_clipping == 1.0


@pytest.mark.parametrize(
    "dtype, fp16, bf16",
    [(torch.float16, True, False), (torch.bfloat16, False, True), (torch.float32, False, False)],
)
def test_auto_precision_follows_model_dtype(dtype, fp16, bf16):
    data = {"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
    cfg = resolve(data, model=StubModel(dtype=dtype))
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (fp16, bf16)


def test_auto_precision_without_a_model_is_fp32():
    cfg = resolve({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert cfg.compute_dtype == torch.float32


def test_auto_zero_buffers_follow_hidden_size():
    data = {
        "train_batch_size": 8,
        "zero_optimization": {
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    zero = resolve(data, model=StubModel(hidden_size=64)).zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.param_persistence_threshold == 640
    zero = resolve(data, model=StubModel(hidden_size=None, hidden_sizes=[32, 96, 64])).zero_optimization
    assert zero.reduce_bucket_size == 96 * 96


def test_auto_zero_buffers_without_hidden_size_name_the_key():
    data = {"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": "auto"}}
    message = error_of(resolve, data)
    assert "zero_optimization.reduce_bucket_size" in message and "no model was given" in message
    message = error_of(resolve, data, model=StubModel(hidden_size=None))
    assert "set zero_optimization.reduce_bucket_size to a number" in message


def test_auto_optimizer_params_get_defaults_but_lr_is_required():
    params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    data = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": params}}
    message = error_of(resolve, data)
    assert "optimizer.params.lr" in message
    cfg = resolve(data, auto_values={"optimizer.params.lr": 3e-4})
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def test_auto_scheduler_params():
    data = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    }
    assert resolve(data).scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}


def test_auto_warmup_max_lr_without_known_lr_is_an_error():
    data = {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    assert "scheduler.params.warmup_max_lr" in error_of(resolve, data)


def test_auto_scheduler_steps_name_the_exact_key():
    data = {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    message = error_of(resolve, data)
    assert (
        'scheduler.params.total_num_steps is "auto" and zerotrain cannot infer it here: '
        "set a number, or let `zerotrain train` fill it"
    ) in message
    cfg = resolve(data, auto_values={"scheduler.params.total_num_steps": 100})
    assert cfg.scheduler.params["total_num_steps"] == 100


def test_any_other_auto_names_its_path():
    data = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": "auto"}}}
    assert "optimizer.params.momentum" in error_of(resolve, data)


def all_values(tree):
    if isinstance(tree, dict):
        return [v for item in tree.values() for v in all_values(item)]
    if isinstance(tree, list):
        return [v for item in tree for v in all_values(item)]
    return [tree]


def test_resolved_config_has_no_auto_left():
    cfg = load_config(CONFIGS / "guide-zero2-auto.jsonc")
    cfg.zero_optimization.offload_optimizer = None
    assert "auto" in all_values(cfg.model_dump())
    cfg = resolve_config(
        cfg,
        world_size=2,
        model=StubModel(hidden_size=32, dtype=torch.float16),
        auto_values={"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 1e-4,
                     "scheduler.params.warmup_num_steps": 10},
    )
    assert "auto" not in all_values(cfg.model_dump())
    assert cfg.compute_dtype == torch.float16


def test_resolve_reports_all_problems_at_once():
    data = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    message = error_of(resolve, data)
    for key in ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "scheduler.params.warmup_num_steps"):
        assert key in message


@pytest.mark.slow
def test_resolve_with_a_real_llama_model():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=32,
        )
    ).to(torch.bfloat16)
    data = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    cfg = resolve(data, model=llama)
    assert cfg.bf16.enabled is True and cfg.zero_optimization.reduce_bucket_size == 256
