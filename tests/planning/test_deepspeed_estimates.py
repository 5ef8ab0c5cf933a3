"""DeepSpeed's estimator functions on zerotrain: the same bytes and the same tables as DeepSpeed,
a meta-device model estimated like the real one, and the guides' import under the stand-in.

Expected values were recorded by running DeepSpeed 0.19.8's own functions
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py) in /work/main/.venv-bench with
DS_ACCELERATOR=cpu, Python 3.11, on totals and on real (CPU) tiny models.
"""

from __future__ import annotations

import argparse
import json

import pytest

from zerotrain.planning.deepspeed_estimates import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zerotrain.planning.model_source import load_meta_model

# DeepSpeed 0.19.8 on Python 3.11 writes `f"{OffloadDeviceEnum.cpu:4}"` as "OffloadDeviceEnum.cpu"
# (3.11's enum formatting); the guides, and zerotrain, show the intended "cpu " there.
def _as_in_the_guides(deepspeed_text: str) -> str:
    return deepspeed_text.replace("OffloadDeviceEnum.cpu", "cpu ")


# --- recorded from DeepSpeed 0.19.8 -------------------------------------------------------
# estimate_zero2_model_states_mem_needs(P, gpus_per_node, nodes, cpu_offload) -> (cpu, gpu)
DS_ZERO2 = {
    (7e9, 8, 1, True): (336000000000, 14000000000),
    (7e9, 8, 1, False): (336000000000, 29750000000),
    (7e9, 8, 4, True): (1344000000000, 14000000000),
    (7e9, 8, 4, False): (336000000000, 17937500000),
    (6738415616, 8, 1, False): (323443949568, 28638266368),
    (6738415616, 3, 3, True): (363874443264, 13476831232),
    (6738415616, 3, 3, False): (121291481088, 26953662464),
}
# estimate_zero3_model_states_mem_needs(P, L, gpus_per_node, nodes, cpu_offload, cpu_offload_params, zero_init)
# -> (cpu, gpu, largest layer bytes)
DS_ZERO3 = {
    (7e9, 131e6, 8, 1, True, True, True): (189000000000, 524000000, 524000000),
    (7e9, 131e6, 8, 1, True, True, False): (336000000000, 524000000, 524000000),
    (7e9, 131e6, 8, 1, True, False, True): (168000000000, 2274000000, 524000000),
    (7e9, 131e6, 8, 1, False, True, True): (6288000000, 16274000000, 524000000),
    (7e9, 131e6, 8, 1, False, False, False): (336000000000, 16274000000, 524000000),
    (7e9, 131e6, 8, 4, True, True, True): (47250000000, 524000000, 524000000),
    (7e9, 131e6, 8, 4, True, False, True): (42000000000, 961500000, 524000000),
    (7e9, 131e6, 8, 4, False, False, True): (6288000000, 4461500000, 524000000),
    # DeepSpeed's float arithmetic ends one byte short here: the same order of operations must too.
    (7e9, 131e6, 3, 3, True, False, True): (55999999999, 2079555555, 524000000),
    (7e9, 131e6, 3, 3, True, False, False): (126000000000, 2079555555, 524000000),
    (6738415616, 131072000, 8, 4, True, True, True): (45484305408, 524288000, 524288000),
    (6738415616, 131072000, 3, 3, True, False, True): (53907324928, 2021713692, 524288000),
    (6738415616, 131072000, 3, 3, False, True, True): (2359296000, 14001119232, 524288000),
}
DS_ZERO2_COLD_7B_8GPUS_1NODE = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 1 node, 8 GPUs per node.\n"
    "SW: Model with 7000M total params.\n  per CPU  |  per GPU |   Options\n"
    "  312.92GB |  13.04GB | offload_optimizer=OffloadDeviceEnum.cpu\n  312.92GB |  27.71GB | offload_optimizer=none\n"
)
DS_ZERO2_COLD_7B_8GPUS_4NODES = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 4 nodes, 8 GPUs per node.\n"
    "SW: Model with 7000M total params.\n  per CPU  |  per GPU |   Options\n"
    " 1251.70GB |  13.04GB | offload_optimizer=OffloadDeviceEnum.cpu\n  312.92GB |  16.71GB | offload_optimizer=none\n"
)
DS_ZERO3_COLD_7B_8GPUS_1NODE = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 1 node, 8 GPUs per node.\n"
    "SW: Model with 7000M total params, 131M largest layer params.\n  per CPU  |  per GPU |   Options\n"
    "  176.02GB |   0.49GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "  312.92GB |   0.49GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "  156.46GB |   2.12GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "  312.92GB |   2.12GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "    5.86GB |  15.16GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
    "  312.92GB |  15.16GB | offload_param=none, offload_optimizer=none, zero_init=0\n"
)
DS_ZERO3_COLD_7B_8GPUS_4NODES = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 4 nodes, 8 GPUs per node.\n"
    "SW: Model with 7000M total params, 131M largest layer params.\n  per CPU  |  per GPU |   Options\n"
    "   44.00GB |   0.49GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "  312.92GB |   0.49GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "   39.12GB |   0.90GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "  312.92GB |   0.90GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "    5.86GB |   4.16GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
    "  312.92GB |   4.16GB | offload_param=none, offload_optimizer=none, zero_init=0\n"
)
# `_all_live` on a real (CPU) tiny Llama (hidden 64, 2 layers, vocab 1000, untied), 8 GPUs x 4 nodes.
TINY_LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
DS_ZERO2_LIVE_TINY_LLAMA_8GPUS_4NODES = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 4 nodes, 8 GPUs per node.\n"
    "SW: Model with 0M total params.\n  per CPU  |  per GPU |   Options\n"
    "    0.04GB |   0.00GB | offload_optimizer=OffloadDeviceEnum.cpu\n    0.01GB |   0.00GB | offload_optimizer=none\n"
)
DS_ZERO3_LIVE_TINY_LLAMA_1GPU_1NODE = (
    "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with 1 node, 1 GPU per node.\n"
    "SW: Model with 0M total params, 0M largest layer params.\n  per CPU  |  per GPU |   Options\n"
    "    0.01GB |   0.00GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "    0.01GB |   0.00GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "    0.00GB |   0.00GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1\n"
    "    0.00GB |   0.00GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0\n"
    "    0.00GB |   0.00GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
    "    0.00GB |   0.00GB | offload_param=none, offload_optimizer=none, zero_init=0\n"
)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(DS_ZERO2))
def test_zero2_bytes_equal_deepspeeds(key):
    assert estimate_zero2_model_states_mem_needs(*key) == DS_ZERO2[key]


@pytest.mark.parametrize("key", list(DS_ZERO3))
def test_zero3_bytes_equal_deepspeeds(key):
    assert estimate_zero3_model_states_mem_needs(*key) == DS_ZERO3[key]


@pytest.mark.parametrize("nodes,zero2,zero3", [
    (1, DS_ZERO2_COLD_7B_8GPUS_1NODE, DS_ZERO3_COLD_7B_8GPUS_1NODE),
    (4, DS_ZERO2_COLD_7B_8GPUS_4NODES, DS_ZERO3_COLD_7B_8GPUS_4NODES),
])
def test_cold_tables_print_deepspeeds_text(capsys, nodes, zero2, zero3):
    estimate_zero2_model_states_mem_needs_all_cold(7e9, num_gpus_per_node=8, num_nodes=nodes)
    assert capsys.readouterr().out == _as_in_the_guides(zero2)
    estimate_zero3_model_states_mem_needs_all_cold(7e9, 131e6, num_gpus_per_node=8, num_nodes=nodes)
    assert capsys.readouterr().out == _as_in_the_guides(zero3)


def _real_tiny_llama():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA))


def test_live_tables_of_a_real_model_print_deepspeeds_text(capsys):
    model = _real_tiny_llama()
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=4)
    assert capsys.readouterr().out == _as_in_the_guides(DS_ZERO2_LIVE_TINY_LLAMA_8GPUS_4NODES)
    estimate_zero3_model_states_mem_needs_all_live(model)
    assert capsys.readouterr().out == _as_in_the_guides(DS_ZERO3_LIVE_TINY_LLAMA_1GPU_1NODE)


def test_a_meta_model_is_estimated_like_the_real_one(capsys):
    # DeepSpeed counts by data_ptr(): every meta parameter is at 0, so it would see one tensor.
    # Billions of parameters make the printed GB tell the counts apart.
    sizes = {**TINY_LLAMA, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
             "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 1}
    from transformers import AutoConfig

    meta = load_meta_model("llama", sizes)
    tables = []
    for model in (meta, None):
        if model is None:  # the real model, small enough to allocate: one layer, 32k vocabulary
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes))
        estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
        estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
        tables.append(capsys.readouterr().out)
        del model
    assert tables[0] == tables[1]
    assert "SW: Model with 78M total params, 32M largest layer params." in tables[0]


def test_the_guides_snippet_runs_under_the_standin(standin_deepspeed, capsys):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold as cold3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live as live2

    assert live2 is estimate_zero2_model_states_mem_needs_all_live
    live2(load_meta_model("llama", TINY_LLAMA), num_gpus_per_node=8, num_nodes=4)
    assert capsys.readouterr().out == _as_in_the_guides(DS_ZERO2_LIVE_TINY_LLAMA_8GPUS_4NODES)
    cold3(7e9, 131e6, num_gpus_per_node=8, num_nodes=4)
    assert capsys.readouterr().out == _as_in_the_guides(DS_ZERO3_COLD_7B_8GPUS_4NODES)


# --- `zerotrain estimate` (parser built on a fresh ArgumentParser until cli.py wires it) ----

def _estimate(*argv: str) -> int:
    from zerotrain.planning.estimate_command import add_estimate_parser

    parser = argparse.ArgumentParser(prog="zerotrain")
    add_estimate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", *argv])
    return args.handler(args)


def _overrides(sizes: dict) -> list[str]:
    return [token for key, value in sizes.items() for token in ("--config-override", f"{key}={value}")]


def test_estimate_deepspeed_format_prints_both_tables(tmp_path, capsys):
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **TINY_LLAMA).save_pretrained(tmp_path)
    assert _estimate(str(tmp_path), "--gpus-per-node", "8", "--nodes", "4", "--deepspeed-format") == 0
    out = capsys.readouterr().out
    assert out.startswith(_as_in_the_guides(DS_ZERO2_LIVE_TINY_LLAMA_8GPUS_4NODES))
    assert "0M total params, 0M largest layer params." in out.split("offload_optimizer=none\n", 1)[1]


def test_estimate_json_carries_deepspeeds_numbers(capsys):
    assert _estimate("llama", *_overrides(TINY_LLAMA), "--gpus-per-node", "8", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["total_params"] == 202048
    assert report["model"]["largest_layer_params"] == 64000
    first2 = report["deepspeed"]["zero2"][0]
    assert (first2["cpu_bytes"], first2["gpu_bytes"]) == estimate_zero2_model_states_mem_needs(202048, 8, 1, True)
    assert len(report["deepspeed"]["zero3"]) == 6


def test_estimate_says_what_is_wrong_with_model(capsys):
    assert _estimate("lama") == 2
    assert "did you mean 'llama'" in capsys.readouterr().err
    assert _estimate("llama", "--config-override", "hidden_size") == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
