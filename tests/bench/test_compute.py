"""`zerotrain bench compute`: the FLOP formulas by hand, the shapes its flags and MODEL give, and the command
through the installed console script (the JSON `zerotrain plan --compute` reads, and its bad-input exits)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import pytest

from zerotrain.bench.compute import DEFAULTS, JSON_KIND, JSON_VERSION, resolve_shapes
from zerotrain.bench.compute_probe import (
    Shapes, attention_flops, matmul_flops, matmul_shapes, median_seconds, overall_tflops,
)

from conftest import device_env, on_gpu

TOP_KEYS = ["kind", "version", "device", "device_type", "dtype", "threads", "shapes", "matmul", "matmul_tflops",
            "attention_tflops", "cpu_adam_elements_per_s", "device_adam_elements_per_s", "copy_gbps",
            "fresh_copy_gbps", "copy_bytes", "host_to_device_gbps", "device_to_host_gbps", "peak_tflops",
            "efficiency", "measured_at"]


# --- the formulas ------------------------------------------------------------------------------

def test_flop_formulas_by_hand():
    # (2 x 4) @ (4 x 3): 6 outputs, 4 multiply-adds each = 48 FLOPs.
    assert matmul_flops(2, 3, 4) == 48
    # b=2, n=3, s=5, d=7: QK^T 2*2*3*5*5*7 = 2100 and AV the same; backward twice the forward.
    assert attention_flops(2, 3, 5, 7) == (4200, 8400)


def test_gemms_of_a_layer_are_the_linears_forward_and_both_backward_gemms():
    shapes = Shapes(hidden=8, intermediate=20, tokens=5, heads=2, head_dim=4, batch=1, seq_len=5)
    gemms = matmul_shapes(shapes)
    assert gemms[:3] == [("qkv forward", 5, 24, 8), ("qkv grad input", 5, 8, 24), ("qkv grad weight", 24, 8, 5)]
    assert [name for name, *_ in gemms[3::3]] == ["o forward", "gate/up forward", "down forward"]
    assert [g[1:] for g in gemms[6:9]] == [(5, 40, 8), (5, 8, 40), (40, 8, 5)]  # gate/up: H x 2I
    assert gemms[9][1:] == (5, 8, 20)  # down: T x I @ I x H
    # Every backward GEMM costs its forward's FLOPs: a layer's linears cost 3 x 2.T.(3H.H + H.H + 2I.H + I.H).
    assert sum(matmul_flops(m, n, k) for _, m, n, k in gemms) == 3 * 2 * 5 * (3 * 64 + 64 + 2 * 160 + 160)


def test_overall_rate_is_total_flops_over_total_time():
    rows = [{"m": 10, "n": 10, "k": 10, "seconds": 1e-6}, {"m": 20, "n": 10, "k": 10, "seconds": 3e-6}]
    # 2000 + 4000 FLOPs in 4 us = 1.5e9 FLOP/s = 0.0015 TFLOP/s (not the mean of the two rates, 0.00167).
    assert overall_tflops(rows) == pytest.approx(0.0015)


def test_median_of_the_timed_calls_after_the_warmup():
    import torch

    calls = []
    assert median_seconds(lambda: calls.append(1), torch.device("cpu"), warmup=2, iters=3) >= 0
    assert len(calls) == 5


# --- the shapes ---------------------------------------------------------------------------------

def _args(**given) -> argparse.Namespace:
    names = ("hidden", "intermediate", "tokens", "heads", "seq_len", "micro_batch")
    return argparse.Namespace(**{name: given.get(name) for name in names})


def test_default_shapes_per_device():
    assert resolve_shapes(_args(), "cuda") == Shapes(4096, 11008, 4096, 32, 128, 2, 2048)
    assert resolve_shapes(_args(), "cpu") == Shapes(512, 1376, 512, 4, 128, 1, 512)
    assert DEFAULTS["cuda"]["optimizer_elements"] == 16 << 20 and DEFAULTS["cpu"]["optimizer_elements"] == 4 << 20


def test_shapes_from_flags_and_from_a_model():
    # --tokens alone: attention's sequence is capped at the tokens, the batch fills them.
    assert resolve_shapes(_args(tokens=256), "cpu") == Shapes(512, 1376, 256, 4, 128, 1, 256)
    assert resolve_shapes(_args(tokens=8192), "cuda") == Shapes(4096, 11008, 8192, 32, 128, 4, 2048)
    assert resolve_shapes(_args(hidden=768, heads=12), "cpu").head_dim == 64
    # MODEL's dims (a GQA-free 1B: 32 heads of 64) and tokens = seq-len x micro-batch.
    dims = {"hidden": 2048, "intermediate": 8192, "heads": 32, "head_dim": 64, "seq_len": 1024}
    assert resolve_shapes(_args(micro_batch=3), "cuda", dims) == Shapes(2048, 8192, 3072, 32, 64, 3, 1024)
    assert resolve_shapes(_args(), "cpu", dims).tokens == 1024  # micro-batch 1 with a model
    with pytest.raises(ValueError, match="does not split into 3 heads"):
        resolve_shapes(_args(hidden=500, heads=3), "cpu")


# --- the model's own layer and head, copies on the device --------------------------------------------

TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}


def _meta(architecture: str, **sizes):
    from zerotrain.planning.model_source import load_meta_model

    return load_meta_model(architecture, sizes)


@pytest.mark.parametrize("architecture, sizes", [
    ("llama", TINY_LLAMA),
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64}),
])
def test_layer_and_head_rates_count_model_flops_per_layer_and_head(monkeypatch, architecture, sizes):
    import torch

    from zerotrain.bench import compute_probe as probe
    from zerotrain.bench.compute import measure_model
    from zerotrain.planning.model_flops import model_flops

    meta = _meta(architecture, **sizes)
    shapes = Shapes(hidden=64, intermediate=160, tokens=3 * 16, heads=4, head_dim=16, batch=3, seq_len=16)
    timed = []

    def one_second(fn, device, warmup, iters):
        fn()  # the layer (or the head) really runs forward and backward once
        timed.append(fn)
        return 1.0

    monkeypatch.setattr(probe, "median_seconds", one_second)
    rates = measure_model(meta, shapes, torch.float32, torch.device("cpu"), 0, 1, lambda text: None)
    f = model_flops(meta, 16)
    # One layer's forward, x3 for forward + backward, per sample, x micro-batch; the head the same way.
    assert rates == {"layer_tflops": pytest.approx(3 * (f.layer_matmul + f.layer_attention) / f.layers * 3 / 1e12),
                     "head_tflops": pytest.approx(3 * f.head_matmul * 3 / 1e12)}
    assert len(timed) == 2


def test_the_one_layer_copy_is_the_models_layer_on_the_device_in_the_dtype():
    import torch

    from zerotrain.bench.compute_probe import measure_head, measure_layer, one_layer_model

    model, layer = one_layer_model(_meta("llama", **TINY_LLAMA), torch.bfloat16, torch.device("cpu"))
    assert model.config.num_hidden_layers == 1 and model.model.layers[0] is layer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # q and o 64 x 64; k and v 64 x (2 kv heads x 16); gate, up, down 64 x 160; two norms of 64.
    assert sum(p.numel() for p in layer.parameters()) == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64
    assert measure_layer(model, layer, 2, 8, torch.device("cpu"), 0, 1) > 0
    assert all(p.grad is not None for p in layer.parameters())  # backward reached every weight of the layer
    assert measure_head(model, 2, 8, torch.device("cpu"), 0, 1) > 0
    assert model.lm_head.weight.grad is not None and model.model.norm.weight.grad is not None


def test_device_copies_into_an_existing_and_a_new_buffer():
    import torch

    from zerotrain.bench.compute_probe import measure_device_copy

    into, fresh = measure_device_copy(torch.device("cpu"), 1 << 20, 0, 2)
    assert into > 0 and fresh > 0


def test_a_model_without_a_layer_count_leaves_the_layer_rates_out():
    import torch
    from torch import nn

    from zerotrain.bench.compute import measure_model

    class NoLayers(nn.Module):
        config = type("Config", (), {"hidden_size": 8, "num_attention_heads": 2})()

    shapes = Shapes(hidden=8, intermediate=16, tokens=4, heads=2, head_dim=4, batch=1, seq_len=4)
    assert measure_model(NoLayers(), shapes, torch.float32, torch.device("cpu"), 0, 1, lambda text: None) == {}


# --- the command ----------------------------------------------------------------------------------

SMALL = ["--hidden", "128", "--intermediate", "352", "--tokens", "128", "--iters", "3", "--warmup", "1",
         "--optimizer-elements", "256K", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", on_gpu("gpu", "gpu")])
def test_cli_writes_the_json_the_step_time_model_reads(zerotrain_cli, device):
    import torch

    proc = zerotrain_cli("bench", "compute", *SMALL, "--json", "out/compute.json", env=device_env(device),
                         timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((zerotrain_cli.cwd / "out" / "compute.json").read_text())
    on_cuda = device == "gpu" and torch.cuda.is_available()
    assert list(doc) == TOP_KEYS
    assert (doc["kind"], doc["version"]) == (JSON_KIND, JSON_VERSION)
    assert doc["device_type"] == ("cuda" if on_cuda else "cpu")
    assert doc["dtype"] == ("bf16" if on_cuda else "fp32") and doc["threads"] == 1
    assert doc["shapes"] == {"hidden": 128, "intermediate": 352, "tokens": 128, "heads": 1, "head_dim": 128}
    rows = doc["matmul"]
    assert [r["name"] for r in rows] == [f"{name} {phase}" for name in ("qkv", "o", "gate/up", "down")
                                         for phase in ("forward", "grad input", "grad weight")]
    assert all(list(r) == ["name", "m", "n", "k", "seconds", "tflops"] for r in rows)
    for r in rows:
        assert r["seconds"] > 0 and r["tflops"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / r["seconds"] / 1e12)
    total_flops = sum(2 * r["m"] * r["n"] * r["k"] for r in rows)
    assert doc["matmul_tflops"] == pytest.approx(total_flops / sum(r["seconds"] for r in rows) / 1e12)
    assert min(r["tflops"] for r in rows) <= doc["matmul_tflops"] <= max(r["tflops"] for r in rows)
    assert doc["attention_tflops"] > 0 and doc["cpu_adam_elements_per_s"] > 0
    assert doc["copy_gbps"] > 0 and doc["fresh_copy_gbps"] > 0
    assert doc["copy_bytes"] == (1 << 30 if on_cuda else 64 << 20)
    if on_cuda:
        assert doc["host_to_device_gbps"] > 0 and doc["device_to_host_gbps"] > 0
        if doc["peak_tflops"] is not None:
            assert doc["efficiency"] == pytest.approx(doc["matmul_tflops"] / doc["peak_tflops"])
    else:
        assert doc["device"].startswith("cpu (")
        assert doc["device_adam_elements_per_s"] == doc["cpu_adam_elements_per_s"]
        assert doc["host_to_device_gbps"] is doc["device_to_host_gbps"] is doc["peak_tflops"] is None
        assert doc["efficiency"] is None
    datetime.fromisoformat(doc["measured_at"])
    assert "matmul_tflops" in proc.stdout and "qkv grad weight" in proc.stdout and "fused" in proc.stdout


@pytest.mark.slow
def test_cli_with_a_model_adds_its_layer_and_head_rates(zerotrain_cli):
    sizes = [f"--config-override={k}={v}" for k, v in TINY_LLAMA.items()]
    proc = zerotrain_cli("bench", "compute", "llama", *sizes, "--seq-len", "32", "--micro-batch", "2", "--iters", "2",
                         "--warmup", "1", "--optimizer-elements", "64K", "--threads", "1", "--json", "c.json",
                         env=device_env("cpu"), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((zerotrain_cli.cwd / "c.json").read_text())
    keys = TOP_KEYS[:TOP_KEYS.index("attention_tflops") + 1] + ["layer_tflops", "head_tflops"]
    assert list(doc)[:len(keys)] == keys and doc["layer_tflops"] > 0 and doc["head_tflops"] > 0
    assert doc["shapes"]["tokens"] == 64 and "layer_tflops" in proc.stdout
    assert doc["copy_bytes"] == 64 << 20  # at least 64 MiB: the model's gradients (168K fp32) are less


@pytest.mark.slow
def test_cli_device_cuda_without_a_gpu_is_exit_2_naming_it(zerotrain_cli):
    proc = zerotrain_cli("bench", "compute", "--device", "cuda", "--json", "c.json", env=device_env("cpu"))
    assert proc.returncode == 2
    assert "no CUDA device is visible" in proc.stderr and "Traceback" not in proc.stderr
    assert not (zerotrain_cli.cwd / "c.json").exists()
