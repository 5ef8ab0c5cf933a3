"""zerotrain train's long-sequence switches: training.tiled_mlp and training.offload_activations, and
DeepSpeed's activation_checkpointing.cpu_checkpointing read as the latter. What they do is tested in
tests/runtime/test_tiled_mlp.py and test_activation_offload.py."""

from __future__ import annotations

from types import SimpleNamespace

from train_config_fixtures import error_of, with_model, write
from zerotrain.train.config_files import load_train_config
from zerotrain.train.memory_options import describe_memory_options
from zerotrain.train.zero_fill import wants_activation_offload, wants_gradient_checkpointing


def test_tiled_mlp_reads_true_or_tokens_per_tile():
    assert load_train_config(None).training.tiled_mlp is False
    assert load_train_config(None, ["--training.tiled_mlp", "true"]).training.tiled_mlp is True
    assert load_train_config(None, ["--training.tiled_mlp", "4096"]).training.tiled_mlp == 4096


def test_deepspeed_cpu_checkpointing_turns_on_checkpointing_with_offload(tmp_path):
    cfg = load_train_config(write(tmp_path / "run.yaml", with_model("""\
        zero:
          activation_checkpointing: {cpu_checkpointing: true}
        """)))
    assert wants_gradient_checkpointing(cfg) and wants_activation_offload(cfg)
    assert not wants_activation_offload(load_train_config(None))


def test_offload_without_checkpointing_is_refused_with_the_key_to_set():
    cfg = load_train_config(None, ["--training.offload_activations", "true"])
    assert "set it to true (or selective)" in error_of(wants_activation_offload, cfg)
    both = ["--training.offload_activations", "true", "--training.gradient_checkpointing", "selective"]
    assert wants_activation_offload(load_train_config(None, both))


def test_memory_options_line_names_tiled_mlp_and_offload_when_on():
    zero = SimpleNamespace(stage=3, offload_optimizer=None, offload_param=None)
    assert "tiled" not in describe_memory_options(True, None, zero)
    line = describe_memory_options(True, None, zero, 2048, True)
    assert "tiled MLP, 2,048 tokens per tile (training.tiled_mlp)" in line
    assert "offloaded to cpu (training.offload_activations)" in line
