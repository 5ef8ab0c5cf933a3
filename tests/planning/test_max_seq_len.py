"""`zerotrain estimate|plan --max-seq-len`: the longest sequence, what to switch on, the YAML that runs it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from zerotrain.planning.activation_memory import LongSequence, estimate_activations

LLAMA = ["llama-3.2-1b", "--gpu-memory", "80GiB", "--cpu-memory", "512GiB"]


def _plan(zerotrain_main, *flags) -> dict:
    result = zerotrain_main("plan", *LLAMA, "--max-seq-len", "--json", *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_longest_sequence_fits_and_one_more_grain_does_not(zerotrain_main):
    answer = _plan(zerotrain_main, "--gpus", "1")
    assert answer["rung"]["fits"] and answer["max_seq_len"] % 1024 == 0
    from zerotrain.planning.ladder import ladder
    from zerotrain.planning.model_source import load_meta_model
    from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung

    rung = next(r for r in ladder(allow_nvme=False) if r.name == answer["rung"]["rung"])
    hardware = Hardware(1, 1, 80 * 2**30, 512 * 2**30)
    longer = Workload(answer["max_seq_len"] + 1024, 1, "bf16")
    assert not estimate_rung(load_meta_model("llama-3.2-1b", {}), rung, longer, hardware).fits


@pytest.mark.slow
def test_each_switch_goes_longer_and_the_yaml_turns_them_on(zerotrain_main):
    plain = _plan(zerotrain_main, "--gpus", "8")
    every = _plan(zerotrain_main, "--gpus", "8", "--sequence-parallel", "8", "--tiled-mlp", "--offload-activations",
                  "--loss-chunk-tokens", "4096")
    assert every["max_seq_len"] > 8 * plain["max_seq_len"]  # issue 37's target for the switches together
    suggested = {s["set"]: s["max_seq_len"] for s in plain["to_go_longer"]}
    assert set(suggested) == {"training.tiled_mlp: true", "training.offload_activations: true",
                              "training.loss_chunk_tokens: 4096", "training.sequence_parallel_size: 8",
                              "all of the above"}
    assert suggested["all of the above"] == max(suggested.values()) > plain["max_seq_len"]
    train = every["train_yaml"]
    assert train["data"]["seq_len"] == every["max_seq_len"]
    assert {k: train["training"][k] for k in ("tiled_mlp", "offload_activations", "sequence_parallel_size",
                                               "loss_chunk_tokens")} == {
        "tiled_mlp": True, "offload_activations": True, "sequence_parallel_size": 8, "loss_chunk_tokens": 4096}
    assert every["switches"]["sequence_parallel_size"] == 8 and every["to_go_longer"] == []


@pytest.mark.slow
def test_offloaded_activations_are_held_to_the_host_memory(zerotrain_main):
    flags = ("--gpus", "8", "--offload-activations", "--tiled-mlp", "--loss-chunk-tokens", "4096")
    roomy = _plan(zerotrain_main, *flags)
    tight = zerotrain_main("plan", "llama-3.2-1b", "--gpu-memory", "80GiB", "--cpu-memory", "96GiB",
                           "--max-seq-len", "--json", *flags)
    tight = json.loads(tight.stdout)
    assert tight["max_seq_len"] < roomy["max_seq_len"]  # the host, not the GPU, is what runs out
    rung = tight["rung"]
    assert rung["cpu_bytes_per_node"]["offloaded activations"] > 0
    assert rung["cpu_total_per_node"] + 2 * 2**30 + 8 * 4 * 2**30 <= 96 * 2**30


@pytest.mark.slow
def test_estimate_answers_the_same_as_plan_and_prints_the_yaml(zerotrain_main):
    planned = _plan(zerotrain_main, "--gpus", "2", "--tiled-mlp")
    text = zerotrain_main("estimate", *LLAMA, "--gpus-per-node", "2", "--tiled-mlp", "--max-seq-len")
    assert text.returncode == 0, text.stderr
    assert f"Longest sequence: {planned['max_seq_len']:,} tokens per sample" in text.stdout
    assert yaml.safe_load(text.stdout.split("zerotrain train YAML:\n")[1]) == planned["train_yaml"]


def test_sequence_parallel_keeps_a_ranks_share_and_adds_the_exchange():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, vocab_size=128)
    whole = estimate_activations(config, 4096, 1, torch.bfloat16)
    split = estimate_activations(config, 4 * 4096, 1, torch.bfloat16, long_sequence=LongSequence(4))
    tokens, heads_bytes = 4096, 2 * 4096 * 4 * 16  # a rank's tokens; q's bytes (4 heads of 16)
    kv_replicated = 2 * 2 * tokens * (4 - 1) * 16  # one KV head made four, for k and v
    assert split.per_layer_bytes == whole.per_layer_bytes + heads_bytes + kv_replicated
    assert split.transient_bytes == 2 * heads_bytes
    with pytest.raises(ValueError, match="sequence parallelism runs on sdpa"):
        estimate_activations(config, 4096, 1, torch.bfloat16, "eager", long_sequence=LongSequence(2))


def test_offloaded_inputs_are_pinned_on_the_host_and_gone_from_the_gpu():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, vocab_size=128)
    kept = estimate_activations(config, 1000, 1, torch.bfloat16)
    off = estimate_activations(config, 1000, 1, torch.bfloat16, long_sequence=LongSequence(offload_activations=True))
    layer_input = 2 * 1000 * 96
    assert kept.saved(True) - off.saved(True) == 3 * layer_input
    assert off.host(True) == 3 * 2**18 and off.host(False) == 0  # 192,000 bytes pin 256 KiB
