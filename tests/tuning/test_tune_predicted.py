"""`zerotrain tune` with speeds: trials in predicted order, measured beside predicted in the summary."""

from __future__ import annotations

import argparse
import json

import torch

from zerotrain.autotuning.results import write_results
from zerotrain.autotuning.search_space import experiments
from zerotrain.autotuning.tune_command import _predictions
from zerotrain.planning.rung_memory import Hardware

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def _probe(tmp_path):
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"kind": "zerotrain-bench-compute", "version": 1, "device": "cpu (test)",
                                "device_type": "cpu", "matmul_tflops": 0.02, "attention_tflops": 0.01,
                                "cpu_adam_elements_per_s": 2e8, "device_adam_elements_per_s": 2e8}))
    return path


def _args(compute=None):
    return argparse.Namespace(gpu=None, intra_node=None, inter_node=None, compute=compute, comm=None, gpu_memory=None)


def test_trials_run_in_predicted_order_and_the_summary_puts_measured_beside_predicted(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    hardware = Hardware(2)
    candidates, _ = experiments(model, hardware, 64, 8, "fp32", {})
    none, why = _predictions(_args(), candidates, model, hardware, 64, "fp32", {}, cuda=False)
    assert none == {} and "--compute" in why  # a CPU without a probe: GPU defaults would say nothing
    predicted, why = _predictions(_args(_probe(tmp_path)), candidates, model, hardware, 64, "fp32", {}, cuda=False)
    assert set(predicted) == {e.name for e in candidates} and "bench compute" in why
    ordered = sorted(candidates, key=lambda e: predicted[e.name])
    offloaded = [i for i, e in enumerate(ordered) if e.rung.offload_optimizer != "none"]
    assert offloaded and min(offloaded) > 0  # the CPU optimizer's step is never predicted fastest here
    first = ordered[0]
    exps = [{"name": e.name, "config": {}, "predicted_gpu_bytes": 0, "predicted_step_s": predicted[e.name]}
            for e in ordered]
    record = {"name": first.name, "status": "ok", "metrics": {"throughput": 10.0, "latency": 0.5},
              "runs": [{"throughput": 10.0, "latency": 0.5}]}
    write_results(tmp_path / "results", tmp_path / "exps", exps, [record], [], "throughput")
    line = next(l for l in (tmp_path / "results" / "summary.txt").read_text().splitlines() if l.startswith(first.name))
    assert "0.5 s measured" in line and f"{predicted[first.name]:.3g} s predicted" in line
