"""Loading a DeepSpeed config: the inputs accepted (dict, JSON with comments, YAML, base64,
old key names and aliases) and the messages for the ones refused."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from config_fixtures import error_of
from zerotrain.config import ConfigError, ZeroTrainConfig, check_supported, load_config


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


def test_dotted_top_level_keys_of_a_known_section_change_nothing_and_are_named(caplog):
    # TRL's prepare_deepspeed writes these for its ZeRO-3 reference model; DeepSpeed reads only
    # the keys it knows, so they have no effect there either.
    trl = {"zero_optimization.reduce_bucket_size": 64 * 64,
           "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
           "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64}
    with caplog.at_level("WARNING", logger="zerotrain"):
        cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3}, **trl})
    assert cfg.zero_optimization.reduce_bucket_size == load_config({"zero_optimization": {"stage": 3}}).zero_optimization.reduce_bucket_size
    assert "'zero_optimization.reduce_bucket_size'" in caplog.text and "no effect" in caplog.text


def test_a_dotted_key_whose_section_is_misspelled_is_still_an_error():
    with pytest.raises(ConfigError, match="zero_optimizaton.stage.*did you mean 'zero_optimization'"):
        load_config({"zero_optimizaton.stage": 3})
