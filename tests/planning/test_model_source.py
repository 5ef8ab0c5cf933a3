"""`load_meta_model` builds MODEL on the meta device from each kind of source; `count_parameters`
counts by identity (tied weights once) and finds DeepSpeed's "largest layer"."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.config.errors import ConfigError
from zerotrain.planning.model_source import count_parameters, load_meta_model

TINY_LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
TINY_GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128}

# DeepSpeed 0.19.8's `model_to_params` (stage3.py) on these two models built for real on the CPU
# (transformers 5.23, /work/main/.venv-bench): (total, largest layer). GPT-2 ties lm_head to wte.
DEEPSPEED_COUNTS = {"llama": (202048, 64000), "gpt2": (172288, 64000)}


def _real(architecture: str, sizes: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **sizes))


@pytest.mark.parametrize("architecture,sizes", [("llama", TINY_LLAMA), ("gpt2", TINY_GPT2)])
def test_meta_model_counts_equal_deepspeeds_counts_of_the_real_model(architecture, sizes):
    model = load_meta_model(architecture, sizes)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model) == DEEPSPEED_COUNTS[architecture]
    assert count_parameters(_real(architecture, sizes)) == DEEPSPEED_COUNTS[architecture]


def test_tied_weights_count_once_on_the_meta_device():
    model = load_meta_model("gpt2", TINY_GPT2)
    assert model.lm_head.weight is model.transformer.wte.weight
    every_tensor = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    total, largest = count_parameters(model)
    assert total == every_tensor - 1000 * 64
    assert largest == 1000 * 64  # the embedding: the module with the most parameters of its own


def test_a_hf_directory_and_its_config_json_keep_their_own_vocabulary(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **TINY_LLAMA).save_pretrained(tmp_path)
    by_dir = load_meta_model(tmp_path)
    by_file = load_meta_model(tmp_path / "config.json")
    assert by_dir.config.vocab_size == 1000
    assert count_parameters(by_dir) == count_parameters(by_file) == DEEPSPEED_COUNTS["llama"]
    wider = load_meta_model(tmp_path, {"vocab_size": 2000})
    assert count_parameters(wider)[0] == DEEPSPEED_COUNTS["llama"][0] + 2 * 1000 * 64


def test_a_train_yaml_estimates_its_model_section(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({"model": {"architecture": "llama", "config_overrides": TINY_LLAMA}}))
    model = load_meta_model(config)
    assert next(model.parameters()).device == torch.device("meta")
    assert count_parameters(model) == DEEPSPEED_COUNTS["llama"]


def test_an_architecture_name_is_its_default_model_and_a_train_yaml_takes_the_trainers_tokenizer(tmp_path):
    # `estimate llama` used to take the byte-level tokenizer's 259 tokens: 6.48B parameters, not
    # Llama-2-7B's 6.74B. A train YAML's model section is built as `zerotrain train` builds it.
    from zerotrain.planning.model_source import assumed_sizes
    from zerotrain.train.data import load_tokenizer

    seven_b = load_meta_model("llama")
    assert count_parameters(seven_b)[0] == 6_738_415_616 and seven_b.config.vocab_size == 32000
    note = assumed_sizes("llama", seven_b, {})
    assert "LlamaConfig's defaults for vocab_size 32000, hidden_size 4096" in note
    sizes = {k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"}
    assert load_meta_model("llama", sizes).config.vocab_size == 32000
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({"model": {"architecture": "llama", "config_overrides": sizes}}))
    assert load_meta_model(config).config.vocab_size == len(load_tokenizer(None, None))
    assert assumed_sizes(str(config), load_meta_model(config), {}) is None


def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_meta_model(tmp_path / "absent" / "config.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_meta_model(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="no config.json"):
        load_meta_model(tmp_path)


def test_an_unknown_architecture_suggests_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'llama'"):
        load_meta_model("lama")


@pytest.mark.slow
def test_zerotrain_estimate_command_prints_deepspeeds_tables_for_a_model_section(zerotrain_main):
    # In this process: tests/planning/test_plan.py runs `estimate` as the console script
    sizes = ["--config-override", "hidden_size=64", "--config-override", "num_hidden_layers=2",
             "--config-override", "intermediate_size=128", "--config-override", "num_attention_heads=4"]
    done = zerotrain_main("estimate", "llama", *sizes, "--gpus-per-node", "2", "--deepspeed-format", check=True)
    assert "Estimated memory needed for params, optim states and gradients" in done.stdout
    assert "offload_param=cpu , offload_optimizer=cpu , zero_init=1" in done.stdout
    missing = zerotrain_main("estimate", "no/such/model_dir")
    assert missing.returncode == 2 and "no/such/model_dir" in missing.stderr


@pytest.mark.slow
def test_the_shipped_models_are_found_by_name_from_any_folder(zerotrain_main):
    # The docs' examples name them so: they run from outside the checkout (zerotrain_main runs from a
    # temporary folder), the configs ship in the package (tests/test_install.py checks the wheel's files).
    done = zerotrain_main("estimate", "llama-2-7b", "--json", check=True)
    assert json.loads(done.stdout)["model"]["total_params"] == 6_738_415_616
    missing = zerotrain_main("estimate", "llama-2-13b")
    assert missing.returncode == 2 and "llama-2-7b" in missing.stderr and "llama-3.2-1b" in missing.stderr
