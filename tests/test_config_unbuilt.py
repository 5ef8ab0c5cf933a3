"""Features not built yet: each is refused with a fix when switched on, and passes when off."""

from __future__ import annotations

import pytest

from config_fixtures import error_of, resolve
from zerotrain.config import check_supported, load_config
from zerotrain.config.unsupported import NOT_YET_BUILT


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


def test_hugging_face_amp_auto_counts_as_off():
    cfg = resolve({"train_batch_size": 8, "amp": {"enabled": "auto", "opt_level": "auto"}})
    assert cfg.other_deepspeed_keys == {}
