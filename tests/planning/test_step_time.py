"""The step-time model: FLOPs as the profiler counts them, the engine's collectives and their bytes,
overlap, scaling from 1 to 4,096 GPUs, and the plan that picks the fastest rung that fits."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zerotrain.planning.hardware_rates import fit_collective, named_rates
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_flops import model_flops
from zerotrain.planning.rung_memory import Hardware, Workload
from zerotrain.planning.step_time import collective_s, predict_step

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}


def _llama(device: str, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **{**TINY, **sizes})
    cfg._attn_implementation = "eager"  # the counter sees eager attention's matmuls
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg)


def _preset(name: str):
    from zerotrain.planning.model_source import load_meta_model

    return load_meta_model(name)


def test_flops_from_sizes_equal_the_counters_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = _llama("cpu")
    batch, seq = 2, 32
    ids = torch.randint(0, TINY["vocab_size"], (batch, seq))
    with FlopCounterMode(display=False) as fwd_counter:
        loss = model(input_ids=ids, labels=ids).loss
    with FlopCounterMode(display=False) as bwd_counter:
        loss.backward()
    counted = model_flops(_llama("meta"), seq).per_micro_batch(batch, recompute=False)
    # Rotary embeddings add one tiny matmul (positions x frequencies) the sizes leave out.
    assert counted["forward"] == pytest.approx(fwd_counter.get_total_flops(), rel=0.01)
    assert counted["backward"] == pytest.approx(bwd_counter.get_total_flops(), rel=0.02)


def test_gpt2_conv1d_layers_are_counted_as_matmuls():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64))
    f = model_flops(model, 16)
    per_layer = 64 * 3 * 64 + 64 * 64 + 2 * 64 * 256  # qkv, proj, fc, fc-proj
    assert f.layer_matmul == 2 * 16 * 2 * per_layer and f.head_matmul == 2 * 16 * 64 * 300


def test_a_collective_fitted_from_bench_comm_rows_gives_back_its_latency_and_bandwidth():
    from zerotrain.bench.bandwidth import bandwidth_row

    latency, busbw, ranks = 40e-6, 12.5, 4
    rows = []
    for size in (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 26):
        t = latency + size * 2 * (ranks - 1) / ranks / (busbw * 1e9)
        rows.append(bandwidth_row("all_reduce", size, ranks, t, 2 * size).as_dict())
    fit = fit_collective(rows)
    assert fit.busbw_gbps == pytest.approx(busbw, rel=1e-6) and fit.fixed_s == pytest.approx(latency, rel=1e-6)
    rates = replace(named_rates("h100"), fits={"all_reduce": fit})
    assert collective_s("all_reduce", 1 << 22, ranks, 8, rates) == pytest.approx(
        latency + (1 << 22) * 1.5 / (busbw * 1e9), rel=1e-9)


def test_bytes_per_rank_are_two_psi_below_stage_3_and_up_to_three_psi_at_stage_3():
    model = _preset("llama-2-7b")
    psi_bytes = 2 * sum(p.numel() for p in model.parameters())  # bf16
    rates = named_rates("h100", inter="ib-ndr")
    for stage in (0, 1, 2, 3):
        sent = predict_step(model, Rung(stage), Workload(4096, 1), Hardware(8, 2), rates).bytes_sent
        total = sum(sent.values())
        if stage < 3:
            assert total == pytest.approx(2 * psi_bytes, rel=0.01), stage
        else:
            # The live limit (1e9 elements) keeps the last layers of forward for backward: just under 3 Psi.
            assert 2.6 * psi_bytes < total < 3.0 * psi_bytes


def test_with_overlap_communication_hides_and_without_it_every_collective_adds():
    model = _preset("llama-3.2-1b")
    hw, work = Hardware(8, 1), Workload(2048, 2)
    rates = named_rates("a100-80gb")
    for stage in (0, 2, 3):
        hidden = predict_step(model, Rung(stage), work, hw, rates)
        serial = predict_step(model, Rung(stage), work, hw, replace(rates, overlap=False))
        # Reductions hide behind backward, stage 3's gathers behind the previous unit; stages 1-2's
        # gather of the updated parameters after the step (half their volume) cannot, nor the last bucket.
        assert hidden.exposed_comm_s < (0.65 if stage == 2 else 0.5) * hidden.comm_s, stage
        assert serial.exposed_comm_s == pytest.approx(serial.comm_s, rel=1e-9)
        assert serial.step_s > hidden.step_s
        assert hidden.step_s == pytest.approx(
            hidden.compute_s + hidden.exposed_comm_s + hidden.offload_s + hidden.optimizer_s, rel=1e-9)


def test_checkpointing_recomputes_a_forward_and_offload_adds_the_cpu_step():
    model = _preset("llama-3.2-1b")
    hw, work, rates = Hardware(8, 1), Workload(2048, 2), named_rates("h100")
    plain = predict_step(model, Rung(2), work, hw, rates)
    ckpt = predict_step(model, Rung(2, gradient_checkpointing=True), work, hw, rates)
    offload = predict_step(model, Rung(2, "cpu"), work, hw, rates)
    assert 1.25 < ckpt.compute_s / plain.compute_s < 1.34  # forward is ~1/3 of forward + backward
    assert offload.offload_s > 0 and offload.optimizer_s == 0 and offload.step_s > plain.step_s
    assert "offload" in offload.bottleneck or "compute" in offload.bottleneck


def test_selective_checkpointing_recomputes_the_elementwise_ops_and_a_chunked_loss_the_head():
    model = _preset("llama-3.2-1b")
    hw, work, rates = Hardware(8, 1), Workload(2048, 2), named_rates("h100")
    plain, full = (predict_step(model, Rung(2, gradient_checkpointing=c), work, hw, rates) for c in (False, True))
    selective = predict_step(model, Rung(2, gradient_checkpointing="selective"), work, hw, rates)
    assert plain.compute_s < selective.compute_s < full.compute_s
    # The measured layer rate, where there is one, says what is not matmul or attention: half the layer here.
    measured = replace(rates, layer_tflops=rates.device.tflops / 2, attention_tflops=rates.device.tflops)
    half = [predict_step(model, Rung(2, gradient_checkpointing=c), work, hw, measured) for c in (False, "selective")]
    recompute = half[1].compute_s - half[0].compute_s  # half of each layer's forward, once more
    forward = half[0].compute_s / 3  # the layers' and the LM head's
    assert 0.3 * forward < recompute < 0.5 * forward
    chunked = predict_step(model, Rung(2), replace(work, loss_chunk_tokens=1024), hw, rates)
    assert plain.compute_s < chunked.compute_s < plain.compute_s * 1.1  # the head's forward again, in backward


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-70b"])
def test_from_one_to_4096_gpus_volume_is_flat_and_the_exposed_share_rises(preset):
    model = _preset(preset)
    rates = named_rates("h100", inter="ib-ndr")
    global_batch, counts = 4096, [1, 8, 64, 512, 4096]
    started = time.perf_counter()
    curves: dict[int, list] = {}
    volume: dict[int, float] = {}
    for stage in (0, 1, 2, 3):
        for gpus in counts:
            hw = Hardware(min(gpus, 8), max(1, gpus // 8))
            per_gpu = global_batch // gpus
            mb = min(per_gpu, 2)
            curves.setdefault(stage, []).append(
                predict_step(model, Rung(stage), Workload(4096, mb), hw, rates, per_gpu // mb))
    per_plan = (time.perf_counter() - started) / (4 * len(counts))
    assert per_plan < 1.0, f"{per_plan:.2f} s per prediction"
    for stage, steps in curves.items():
        assert steps[0].comm_s == 0 and steps[0].exposed_comm_s == 0  # one GPU: nothing to communicate
        # Per rank, per micro-batch without accumulation: the same bytes at every count.
        volumes = [sum(predict_step(model, Rung(stage), Workload(4096, 1), Hardware(min(g, 8), max(1, g // 8)),
                                    rates).bytes_sent.values()) for g in counts[1:]]
        assert max(volumes) == pytest.approx(min(volumes), rel=0.01), stage
        volume[stage] = volumes[-1]
        shares = [s.exposed_share for s in steps[1:]]
        assert all(b >= a - 1e-9 for a, b in zip(shares, shares[1:])), (stage, shares)
        assert shares[-1] > shares[0], stage
    assert volume[0] == pytest.approx(volume[1], rel=0.01) and volume[1] == pytest.approx(volume[2], rel=0.01)
    # Stage 3: gathers in forward and again in backward (less what the live limit keeps), 3 Psi vs 2 Psi.
    assert 1.35 < volume[3] / volume[2] <= 1.5


def test_the_plan_takes_the_fastest_fitting_rung_and_says_why():
    from zerotrain.planning.planner import make_plan

    model = _preset("llama-2-7b")
    rates = named_rates("h100")
    roomy = make_plan(model, Hardware(8, 1, 80 * 2**30, 2**41), 4096, 64, rates=rates)
    tight = make_plan(model, Hardware(8, 1, 40 * 2**30, 2**41), 4096, 64, rates=rates)
    for plan in (roomy, tight):
        chosen = plan.choice_time
        fitting = [t.step_s for e, t in plan.timings if e.fits]
        assert chosen is not None and chosen.step_s <= min(fitting) * 1.03
    assert tight.choice.rung.stage == 3 or tight.choice.rung.offload_optimizer != "none" or \
        tight.choice.rung.gradient_checkpointing
    why = tight.why()
    assert "would be, but" in why and "does not fit" in why, why
    assert all(not e.fits for e in tight.rejected)


@pytest.mark.slow
def test_plan_scale_prints_the_curve_marks_where_communication_shows_and_draws_it(zerotrain_cli, zerotrain_main,
                                                                                  tmp_path):
    png = tmp_path / "scale.png"
    done = zerotrain_cli("plan", REPO / "examples/models/llama-2-7b.json", "--gpus", "8", "--gpu-memory", "80GiB",
                         "--cpu-memory", "1TiB", "--global-batch", "512", "--seq-len", "4096", "--gpu", "a100-80gb",
                         "--inter-node", "100gbe", "--scale", "8,64,512,4096", "--plot", png, check=True)
    out = done.stdout
    assert "Predicted per rung" in out and "tok/s/GPU" in out and "Why: " in out
    assert "Scaling at the same global batch" in out and "communication shows from" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    js = json.loads(zerotrain_main("plan", REPO / "examples/models/llama-2-7b.json", "--gpus", "8", "--gpu-memory",
                                   "80GiB", "--cpu-memory", "1TiB", "--global-batch", "512", "--seq-len", "4096",
                                   "--scale", "8,64", "--json", check=True).stdout)
    assert js["predicted"]["tokens_per_s_per_gpu"] > 0 and js["why"] and len(js["scale"]) >= 4
    assert {p["gpus"] for p in js["scale"][0]["points"]} == {8, 64}
    bad = zerotrain_main("plan", REPO / "examples/models/llama-2-7b.json", "--gpus", "8", "--gpu-memory", "80GiB",
                         "--global-batch", "64", "--plot", png)
    assert bad.returncode == 2 and "--scale" in bad.stderr
