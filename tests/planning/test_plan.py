"""The per-rung memory model, the plan it drives, and the `estimate`/`plan` commands."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.planning.ladder import Rung, ladder
from zerotrain.planning.model_states import model_states_per_rank
from zerotrain.planning.planner import make_plan, min_gpus
from zerotrain.planning.rung_memory import GIB, Hardware, Workload, estimate_rung, rung_config

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
SEVEN_B = "examples/models/llama-2-7b.json"


def _meta(sizes=TINY):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes))


def _overrides(sizes=TINY) -> list[str]:
    return [t for k, v in sizes.items() for t in ("--config-override", f"{k}={v}")]


def test_the_ladder_runs_fastest_first_and_each_offload_step_holds_less_on_the_gpu():
    from pathlib import Path

    from zerotrain.planning.model_source import load_meta_model

    model = load_meta_model(Path(__file__).parents[2] / SEVEN_B)
    rungs = [r for r in ladder(allow_nvme=False, checkpointing=True) if r.gradient_checkpointing is True]
    assert [r.stage for r in rungs] == [0, 1, 2, 2, 3, 3, 3]
    totals = [estimate_rung(model, r, Workload(2048, 1), Hardware(8)).gpu_total for r in rungs]
    assert totals[0] == max(totals) and totals[-1] == min(totals)
    # Within a stage each offload step holds less; across stages not always: on 8 GPUs stage 2 with
    # the optimizer on the CPU holds less than stage 3 (whole parameters vs. sharded states + gathers).
    assert totals[3] < totals[2] and totals[6] < totals[5] < totals[4] and totals[2] < totals[1] < totals[0]
    both = list(ladder(allow_nvme=True))
    assert both[:3] == [Rung(0), Rung(0, gradient_checkpointing="selective"), Rung(0, gradient_checkpointing=True)]
    assert both[-1].uses_nvme


def test_deepspeeds_10b_zero_offload_run_on_one_v100_fits_with_a_chunked_loss():
    # DeepSpeed's ZeRO-Offload tutorial: a 10B GPT-2 (50 layers, hidden 4096, 32 heads), fp16, sequence
    # 1024, micro-batch 10, activation checkpointing, the optimizer on the CPU, one 32 GB V100. With the
    # model's own loss the fp32 logits of 10,240 tokens x 50,257 words alone peak at 6.7 GiB: 7% over.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_embd=4096, n_layer=50, n_head=32, vocab_size=50257, n_positions=1024)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    rung, hardware = Rung(2, "cpu", gradient_checkpointing=True), Hardware(1, gpu_memory=32 * GIB, cpu_memory=512 * GIB)
    whole = estimate_rung(model, rung, Workload(1024, 10, "fp16"), hardware)
    chunked = estimate_rung(model, rung, Workload(1024, 10, "fp16", loss_chunk_tokens=1024), hardware)
    assert not whole.fits and whole.gpu_total + whole.gpu_reserve > 1.06 * 32 * GIB
    assert chunked.fits
    assert whole.gpu["logits peak"] - chunked.gpu["logits peak"] > 6 * GIB


TRANSIENT_HOST = ("nvme swap buffers", "optimizer step temporaries", "pinned-memory rounding")  # not model states


@pytest.mark.parametrize("rung", [Rung(0), Rung(1), Rung(2, "cpu"), Rung(3), Rung(3, "cpu", "cpu"), Rung(3, "nvme", "nvme")],
                         ids=lambda r: r.name.replace(" ", ""))
def test_model_states_split_between_gpu_cpu_and_nvme_add_up_to_the_engines_bytes(rung):
    """Every byte of `model_states_per_rank` (checked against memory_breakdown elsewhere) is placed once."""
    model, hw = _meta(), Hardware(gpus_per_node=2, nodes=2, nvme_path="/nvme")
    base = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # shard every tensor
    est = estimate_rung(model, rung, Workload(64, 2, "bf16"), hw, base)
    counted = rung_config(rung, Workload(64, 2, "bf16"), base)
    for key in ("offload_optimizer", "offload_param"):
        if key in counted["zero_optimization"]:
            counted["zero_optimization"][key] = {"device": "cpu"}
    states = sum(model_states_per_rank(model, counted, 4, device_type="cuda").values())
    placed = est.gpu["parameters"] + est.gpu["gradients"] + est.gpu["master + optimizer"]
    placed += sum(v for k, v in {**est.cpu_per_node, **est.nvme_per_node}.items() if k not in TRANSIENT_HOST) // 2
    assert placed == states
    if rung.offload_param == "nvme":
        assert est.nvme_per_node["parameters"] > 0 and "parameters" not in est.cpu_per_node


def test_activations_scale_with_the_micro_batch_and_checkpointing_keeps_less():
    model = _meta()
    one = estimate_rung(model, Rung(2), Workload(128, 1), Hardware())
    four = estimate_rung(model, Rung(2), Workload(128, 4), Hardware())
    assert four.gpu["activations"] == 4 * one.gpu["activations"]
    assert four.gpu["logits peak"] == 4 * one.gpu["logits peak"]
    ckpt = estimate_rung(model, Rung(2, gradient_checkpointing=True), Workload(128, 4), Hardware())
    assert ckpt.gpu["activations"] < four.gpu["activations"]


def test_stage3_gathers_the_root_and_layers_up_to_the_live_limit():
    model = _meta()
    sharded = {"stage3_param_persistence_threshold": 0}  # a tiny model's tensors would all stay whole
    full = estimate_rung(model, Rung(3), Workload(64, 1, "fp32"), Hardware(2),
                         {"zero_optimization": sharded}).gpu["gathered units"]
    n = sum(p.numel() for p in model.parameters())
    assert full == pytest.approx(4 * n, rel=0.01)  # the default live limit (1e9) keeps a tiny model whole
    limited = estimate_rung(model, Rung(3), Workload(64, 1, "fp32"), Hardware(2),
                            {"zero_optimization": {**sharded, "stage3_max_live_parameters": 0}}).gpu["gathered units"]
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = n - 2 * layer
    assert limited == pytest.approx(4 * (root + layer), rel=0.01)  # the root and the one layer computing


def test_the_plan_takes_the_first_rung_that_fits_and_keeps_the_global_batch():
    model = _meta()
    everything = estimate_rung(model, Rung(0), Workload(128, 8), Hardware(2)).gpu_total
    hw = Hardware(2, gpu_memory=everything + GIB)  # stage 0 fits at micro-batch 8 with the 1 GiB reserve, not 16
    plan = make_plan(model, hw, 128, global_batch=32)
    assert plan.choice.rung == Rung(0) and plan.choice.micro_batch == 8 and plan.accumulation == 2
    cfg = plan.deepspeed_config()
    assert cfg["train_batch_size"] == 32 == cfg["train_micro_batch_size_per_gpu"] * 2 * cfg["gradient_accumulation_steps"]


def test_a_tight_gpu_walks_down_and_says_why_each_faster_rung_does_not_fit():
    model = _meta()
    rungs = list(ladder(allow_nvme=False))
    totals = [estimate_rung(model, r, Workload(128, 1), Hardware(2)).gpu_total for r in rungs]
    smallest = totals.index(min(totals))
    hw = Hardware(2, gpu_memory=min(totals) + GIB)  # only the leanest rung fits (the reserve is 1 GiB here)
    plan = make_plan(model, hw, 128, global_batch=2)
    assert smallest > 0 and plan.choice.rung == rungs[smallest] and plan.choice.micro_batch == 1
    assert [r.rung for r in plan.rejected] == rungs[:smallest]
    assert all("over by" in r.overflow[0] and "largest term" in r.overflow[0] for r in plan.rejected)


def test_nvme_rungs_need_a_path_and_cpu_limits_are_checked():
    model = _meta()
    hw = Hardware(1, gpu_memory=GIB + 1000, cpu_memory=1000)
    plan = make_plan(model, hw, 64, global_batch=1)
    assert plan.choice is None and not any(r.rung.uses_nvme for r in plan.rejected)
    offloaded = [r for r in plan.rejected if r.rung.offload_optimizer == "cpu"]
    assert all(any(o.startswith("CPU needs") for o in r.overflow) for r in offloaded)


def test_minimum_gpus_is_the_smallest_count_that_fits():
    from pathlib import Path

    from zerotrain.planning.model_source import load_meta_model

    model = load_meta_model(Path(__file__).parents[2] / SEVEN_B)
    rung, work = Rung(3, gradient_checkpointing=True), Workload(2048, 1)
    hw = Hardware(8, gpu_memory=24 * GIB)
    found = min_gpus(model, rung, work, hw)
    assert found is not None and found > 1

    def fits(count):
        nodes = max(1, -(-count // 8))
        return estimate_rung(model, rung, work, Hardware(min(count, 8), nodes, hw.gpu_memory)).fits

    assert fits(found) and not fits(found - 1 if found <= 8 else found - 8)


def test_a_global_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        make_plan(_meta(), Hardware(4, gpu_memory=80 * GIB), 64, global_batch=6)


@pytest.mark.slow
def test_zerotrain_estimate_prints_every_rung_and_json(zerotrain_cli, zerotrain_main):
    done = zerotrain_cli("estimate", "llama", *_overrides(), "--gpus-per-node", "2", "--seq-len", "128",
                         "--gpu-memory", "2GiB", "--cpu-memory", "8GiB", check=True)
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line[:1].isdigit() and line.split()[1] in ("gpu", "cpu", "nvme")]
    assert len(rows) == 27 and rows[0][:4] == ["0", "gpu", "gpu", "no"]  # 9 memory rungs x no/sel/yes
    assert [row[3] for row in rows[:3]] == ["no", "sel", "yes"]
    assert rows[0][-1] == "yes"
    assert rows[-1][:4] == ["3", "nvme", "nvme", "yes"] and rows[-1][-1] == "no"  # no --nvme
    # A tiny model's figures are in MiB, not rows of 0.00 GiB; the table fits 100 columns unless --wide.
    assert "MiB per GPU" in done.stdout and max(len(" ".join(row)) for row in rows) <= 100
    assert max(len(line) for line in lines if line.split()[:1] and line.split()[0].isdigit()) <= 100
    wide = zerotrain_main("estimate", "llama", *_overrides(), "--wide", check=True).stdout
    assert "activ" in wide and "activ" not in done.stdout
    assert "seq 128, micro-batch 1, bf16, sdpa attention" in done.stdout
    data = json.loads(zerotrain_main("estimate", "llama", *_overrides(), "--json", "--micro-batch", "2",
                                     "--no-gradient-checkpointing", "--attention", "eager", check=True).stdout)
    assert len(data["rungs"]) == 9 and data["workload"]["micro_batch"] == 2
    chunked = json.loads(zerotrain_main("estimate", "llama", *_overrides(), "--json", "--loss-chunk-tokens", "16",
                                        "--no-gradient-checkpointing", check=True).stdout)
    whole = json.loads(zerotrain_main("estimate", "llama", *_overrides(), "--json", "--no-gradient-checkpointing",
                                      check=True).stdout)
    assert chunked["rungs"][0]["gpu_bytes"]["logits peak"] < whole["rungs"][0]["gpu_bytes"]["logits peak"] / 4
    assert data["rungs"][0]["gpu_bytes"]["activations"] > 0 and len(data["deepspeed"]["zero3"]) == 6


@pytest.mark.slow
def test_zerotrain_plan_prints_words_deepspeed_json_and_train_yaml(zerotrain_cli, zerotrain_main, tmp_path):
    import yaml

    done = zerotrain_cli("plan", "llama", *_overrides(), "--gpus", "2", "--gpu-memory", "2GiB",
                         "--seq-len", "128", "--global-batch", "16", check=True)
    out = done.stdout
    assert "Recommended: stage 0, micro-batch 8 x 1 accumulation step x 2 GPUs = global batch 16." in out
    ds_text = out.split("DeepSpeed config (ds_config.json):\n", 1)[1].split("\n\nzerotrain train YAML:", 1)[0]
    ds = json.loads(ds_text)
    from zerotrain.config import load_config

    load_config(ds)  # the config zerotrain (and DeepSpeed) would be given loads as it is
    section = yaml.safe_load(out.split("zerotrain train YAML:\n", 1)[1])
    assert section["zero"]["zero_optimization"] == ds["zero_optimization"]
    bad = zerotrain_main("plan", "llama", *_overrides(), "--gpus", "3", "--gpu-memory", "2GiB", "--global-batch", "16")
    assert bad.returncode == 2 and "multiple of 3" in bad.stderr
    none = zerotrain_main("plan", "llama", *_overrides(), "--gpus", "1", "--gpu-memory", "1GiB", "--global-batch", "1",
                          "--json")
    assert none.returncode == 1 and json.loads(none.stdout)["choice"] is None


@pytest.mark.slow
def test_plan_without_cpu_memory_checks_this_machines_and_says_so(zerotrain_main):
    # A 70B-sized Llama on one 16 GiB GPU: only offloading every state fits the GPU, and that needs
    # about 1 TiB of host memory. Without --cpu-memory it used to be recommended, exit 0.
    import os

    big = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": 8, "vocab_size": 32000}
    done = zerotrain_main("plan", "llama", *_overrides(big), "--gpus", "1", "--gpu-memory", "16GiB",
                          "--global-batch", "8")
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    assert f"CPU memory per node: {machine:.1f} GiB, this machine's" in done.stdout, done.stdout[:2000]
    assert done.returncode == 1 and "Nothing fits" in done.stdout and "Recommended" not in done.stdout
    assert "stage 3 + optimizer cpu + params cpu + checkpointing: CPU needs" in done.stdout
    given = zerotrain_main("plan", "llama", *_overrides(big), "--gpus", "1", "--gpu-memory", "16GiB",
                          "--global-batch", "8", "--cpu-memory", "2TiB")
    assert given.returncode == 0 and "this machine's" not in given.stdout and "Recommended: stage 3" in given.stdout


@pytest.mark.slow
def test_plan_verify_measures_the_chosen_rung_and_falls_past_an_out_of_memory_one(zerotrain_cli):
    """3 real steps on 2 Gloo ranks: model states measured equal the prediction exactly; an OOM on one
    rank at stage 0 (injected) makes the plan fall to stage 1 and say so, without hanging."""
    done = zerotrain_cli("plan", "llama", *_overrides(), "--gpus", "2", "--gpu-memory", "4GiB", "--dtype", "fp32",
                         "--seq-len", "64", "--global-batch", "4", "--verify", "--no-gradient-checkpointing", "--json",
                         env={"ZEROTRAIN_FAULT": "verify:rank1:0:oom"}, timeout=240, check=True)
    plan = json.loads(done.stdout)
    first, second = plan["verification"]
    assert first["rung"] == "stage 0" and first["measured"] == {"oom": True, "oom_rank": 1} and not first["fits"]
    assert second["rung"] == "stage 1" and second["fits"] and plan["choice"]["rung"] == "stage 1"
    assert second["measured"]["model_states"] == second["predicted"]["model_states"]
    measured, predicted = second["measured"]["activations"], second["predicted"]["activations"]
    assert 0.5 * predicted < measured < 1.5 * predicted  # saved tensors only; the peak adds the logits' gradient


def test_a_guides_deepspeed_config_with_auto_values_is_a_base_for_every_rung(fixtures_dir):
    from zerotrain.config.loader import read_config_file

    base = read_config_file(fixtures_dir / "configs" / "guide-zero3-offload.jsonc")
    model = _meta()
    for rung in ladder(allow_nvme=False):
        est = estimate_rung(model, rung, Workload(64, 1, "bf16"), Hardware(2), base)
        assert est.gpu_total > 0


@pytest.mark.slow
def test_a_train_yaml_gives_the_model_sequence_length_and_micro_batch(zerotrain_main):
    import yaml

    (zerotrain_main.cwd / "run.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": "llama", "tokenizer": "byte", "config_overrides": TINY},
        "data": {"format": "synthetic", "seq_len": 96}, "training": {"micro_batch_size": 3},
    }))
    # In this process; test_plan_assumes_train_run.py reads a train YAML's sequence and batch in a fresh one
    done = zerotrain_main("estimate", "run.yaml", "--json", check=True)
    workload = json.loads(done.stdout)["workload"]
    assert (workload["seq_len"], workload["micro_batch"]) == (96, 3)


def _rendezvous_port() -> str:
    import os

    return os.environ["MASTER_PORT"]


@pytest.mark.slow
def test_plan_verify_and_tune_take_master_port_for_their_ranks():
    # `launch` and `train` took --master_port and these did not (a cluster's firewall allows one port).
    from free_ports import free_port

    from zerotrain.cli.main import build_parser
    from zerotrain.planning.local_job import run_local_job

    port = free_port()
    assert run_local_job(_rendezvous_port, 2, master_port=port) == {0: str(port), 1: str(port)}
    parser = build_parser()
    for argv in (["plan", "llama", "--gpus", "1", "--global-batch", "1", "--verify", "--master_port", str(port)],
                 ["tune", "run.yaml", "--master-port", str(port)]):
        assert parser.parse_args(argv).master_port == port


def test_pinned_offload_buffers_are_counted_at_the_power_of_two_torch_pins():
    from zerotrain.planning.model_states import bucket_layouts
    from zerotrain.zero.stage import StagePlan

    model = _meta()
    trainable = [[p for p in model.parameters() if p.requires_grad]]
    bucket = 50_000  # several buckets, none a power of two
    shards = [b.shard_size for b in bucket_layouts(model, trainable, StagePlan(2), 2, 0, bucket, 0)]

    def waste(n: int) -> int:
        return (1 << (n - 1).bit_length()) - n

    base = {"zero_optimization": {"reduce_bucket_size": bucket}}
    work, hw = Workload(64, 1, "bf16"), Hardware(2, gpu_memory=80 * GIB, cpu_memory=512 * GIB)
    est = estimate_rung(model, Rung(2, "cpu"), work, hw, base)
    # Per process: the fp32 master shard and the bf16 gradient shard of every bucket; two processes per node.
    assert est.cpu_per_node["pinned-memory rounding"] == 2 * sum(waste(4 * n) + waste(2 * n) for n in shards)
    # The fit check keeps the OS's and each process's runtime share of the node free.
    assert hw.cpu_reserve == 2 * GIB + 2 * 4 * GIB
    tight = Hardware(2, gpu_memory=80 * GIB, cpu_memory=est.cpu_total + hw.cpu_reserve - 1)
    assert "reserve" in estimate_rung(model, Rung(2, "cpu"), work, tight, base).overflow[0]
    assert "pinned-memory rounding" not in estimate_rung(model, Rung(2), work, hw, base).cpu_per_node
