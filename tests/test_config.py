"""Config loading, validation messages, "auto" resolution, batch arithmetic and the
not-yet-built features, including every reference config users copy today."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotrain.config import (
    ConfigError,
    ZeroTrainConfig,
    check_supported,
    load_config,
    resolve_batch_sizes,
    resolve_config,
)
from zerotrain.config.unsupported import NOT_YET_BUILT

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


class StubModel(nn.Module):
    """A model with one parameter of ``dtype`` and a Hugging Face-style ``config``."""

    def __init__(self, hidden_size: int | None = 64, dtype: torch.dtype = torch.float32, **config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, dtype=dtype))
        if hidden_size is not None:
            config["hidden_size"] = hidden_size
        self.config = SimpleNamespace(**config)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- #
# accepted inputs


def test_loads_a_dict_with_deepspeed_defaults():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4})
    assert isinstance(cfg, ZeroTrainConfig)
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print == 10
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale == 0
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window, cfg.fp16.hysteresis) == (16, 1000, 2)
    assert cfg.fp16.min_loss_scale == 1 and cfg.fp16.consecutive_hysteresis is False
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 0
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.overlap_comm is False  # DeepSpeed's default below stage 3
    assert zero.prefetch_bucket_size == 50_000_000 and zero.param_persistence_threshold == 100_000


def test_loads_json_file_with_hash_and_slash_comments(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        "# a comment line\n"
        "{\n"
        '  "train_micro_batch_size_per_gpu": 2, // trailing slash comment\n'
        '  "wall_clock_breakdown": false, # "Enable timing"\n'
        '  "zero_optimization": {"stage": 2, "allgather_bucket_size": 5e8}\n'
        "}\n"
    )
    cfg = load_config(path)
    assert cfg.train_micro_batch_size_per_gpu == 2
    assert cfg.zero_stage == 2
    assert cfg.zero_optimization.allgather_bucket_size == 500_000_000
    assert load_config(str(path)) == cfg


def test_loads_yaml_file_and_reads_5e8_as_a_number(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text(
        "train_batch_size: 16\n"
        "bf16:\n  enabled: true\n"
        "zero_optimization:\n  stage: 1\n  reduce_bucket_size: 5e8\n"
    )
    cfg = load_config(path)
    assert cfg.train_batch_size == 16 and cfg.bf16.enabled is True
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_loads_base64_encoded_json(encode):
    text = json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}})
    cfg = load_config(encode(text.encode()).decode())
    assert cfg.train_batch_size == 8 and cfg.fp16.enabled is True


def test_float_bucket_sizes_coerce_to_int():
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 2e8, "stage3_max_live_parameters": 1e9}})
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(cfg.zero_optimization.max_live_parameters, int)


def test_auto_values_stay_auto_after_loading():
    cfg = load_config({"train_batch_size": "auto", "gradient_clipping": "auto", "fp16": {"enabled": "auto"}})
    assert cfg.train_batch_size == "auto" and cfg.gradient_clipping == "auto" and cfg.fp16.enabled == "auto"


def test_empty_feature_sections_are_accepted():
    cfg = load_config({"autotuning": {}, "flops_profiler": {}, "activation_checkpointing": {}, "checkpoint": {}})
    check_supported(cfg)


def test_stage3_keys_accept_prefixed_and_plain_names():
    prefixed = load_config({"zero_optimization": {"stage3_prefetch_bucket_size": 7}})
    plain = load_config({"zero_optimization": {"prefetch_bucket_size": 7}})
    assert prefixed.zero_optimization.prefetch_bucket_size == plain.zero_optimization.prefetch_bucket_size == 7


def test_old_gather_fp16_weights_key_maps_to_16bit_key():
    cfg = load_config({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True


def test_bfloat16_section_name_is_an_alias_of_bf16():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled is True
    message = error_of(load_config, {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert "keep only 'bf16'" in message


def test_deprecated_cpu_offload_maps_to_cpu_optimizer_offload():
    cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert load_config({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer is None
    cfg = load_config({"zero_optimization": {"cpu_offload_param": True, "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_param.device == "cpu" and cfg.zero_optimization.offload_param.pin_memory


def test_overlap_comm_defaults_to_true_at_stage_3():
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True


def test_convenience_properties():
    assert load_config({"fp16": {"enabled": True}}).compute_dtype == torch.float16
    assert load_config({"bf16": {"enabled": True}}).compute_dtype == torch.bfloat16
    assert load_config({}).compute_dtype == torch.float32
    assert load_config({"zero_optimization": {"stage": 2}}).zero_stage == 2
    assert load_config({"communication_data_type": "FP32"}).communication_dtype == torch.float32


# --------------------------------------------------------------------------- #
# error messages


def test_unknown_key_names_path_and_closest_key():
    message = error_of(load_config, {"zero_optimization": {"reduce_bucket_sise": 5}})
    assert "zero_optimization.reduce_bucket_sise" in message
    assert "did you mean 'reduce_bucket_size'?" in message


def test_unknown_top_level_key_suggests_the_section():
    message = error_of(load_config, {"optimiser": {"type": "AdamW"}})
    assert "unknown key 'optimiser'" in message and "did you mean 'optimizer'?" in message


def test_wrong_type_names_key_given_value_and_expected():
    message = error_of(load_config, {"zero_optimization": {"stage": "two"}})
    assert 'zero_optimization.stage: got "two", expected an integer from 0 to 3' in message
    message = error_of(load_config, {"gradient_accumulation_steps": 0})
    assert 'gradient_accumulation_steps: got 0, expected a positive integer or "auto"' in message
    message = error_of(load_config, {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    assert 'got "gpu", expected one of "none", "cpu", "nvme"' in message


def test_auto_where_no_rule_exists_is_a_load_error():
    message = error_of(load_config, {"zero_optimization": {"allgather_bucket_size": "auto"}})
    assert "zero_optimization.allgather_bucket_size" in message and "no rule to fill" in message


def test_several_problems_are_reported_together():
    message = error_of(load_config, {"steps_per_prnt": 1, "fp16": {"enabled": "yes please"}, "zero_optimization": 3})
    assert "steps_per_prnt" in message and "fp16.enabled" in message and "zero_optimization" in message
    assert "pydantic" not in message and "Input should" not in message


def test_fp16_and_bf16_both_enabled_is_an_error():
    message = error_of(load_config, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in message


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    assert str(path) in error_of(load_config, path)
    assert "config file not found" in error_of(load_config, str(path))


def test_unparseable_file_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true\n}\n')
    message = error_of(load_config, path)
    assert str(path) in message and "line" in message
    yaml_path = tmp_path / "broken.yaml"
    yaml_path.write_text("a: [1, 2\nb: 3\n")
    assert "broken.yaml, line" in error_of(load_config, yaml_path)


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "'train_batch_size' appears twice" in error_of(load_config, path)


def test_cpu_offload_conflicting_with_offload_section_is_an_error():
    data = {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
    assert "remove 'cpu_offload'" in error_of(load_config, data)


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


def resolve(data: dict, world_size: int = 2, **kwargs) -> ZeroTrainConfig:
    return resolve_config(load_config(data), world_size=world_size, **kwargs)


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


# --------------------------------------------------------------------------- #
# features not built yet


@pytest.mark.parametrize(
    "data, setting",
    [
        ({"zero_optimization": {"elastic_checkpoint": True}}, "zero_optimization.elastic_checkpoint"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint"),
        ({"amp": {"enabled": True}}, "amp"),
    ],
)
def test_unbuilt_feature_is_refused_with_a_fix(data, setting):
    message = error_of(check_supported, load_config(data))
    assert message.startswith(setting)
    assert "not built" in message


def test_unbuilt_feature_message_says_what_to_change():
    message = error_of(check_supported, load_config({"zero_optimization": {"elastic_checkpoint": True}}))
    assert "arrives with a later version" in message
    assert "set zero_optimization.elastic_checkpoint to false" in message


def test_cpu_offload_is_built():
    check_supported(load_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "offload_param": {"device": "cpu"}}}))


def test_nvme_offload_is_built():
    nvme = {"device": "nvme", "nvme_path": "/nvme"}
    check_supported(load_config({"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}))


def test_switched_off_features_pass():
    check_supported(load_config({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "cpu_offload": False},
        "tensorboard": {"enabled": False, "output_path": "/tmp"},
        "checkpoint": {"tag_validation": "Warn"},
        "amp": {"enabled": False},
        "dataloader_drop_last": False,
    }))


def test_every_unbuilt_feature_row_is_off_by_default():
    default = load_config({})
    assert all(row.requested(default) is None for row in NOT_YET_BUILT)


def test_resolve_refuses_unbuilt_features_first():
    data = {
        "zero_optimization": {"elastic_checkpoint": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    assert "elastic checkpoints is not built yet" in error_of(resolve, data)


# --------------------------------------------------------------------------- #
# the reference configs users copy today


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


def test_hugging_face_amp_auto_counts_as_off():
    cfg = resolve({"train_batch_size": 8, "amp": {"enabled": "auto", "opt_level": "auto"}})
    assert cfg.other_deepspeed_keys == {}
