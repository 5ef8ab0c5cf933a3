"""`zerotrain tune`: candidates in the plan's order, pruned by the memory model, timed in one job of 2
Gloo ranks; an out-of-memory trial on one rank is skipped by both without hanging; early stop; the
winner, run twice (--repeats 2), is (within 10%) the fastest configuration when timed by hand; DeepSpeed's
results layout."""

from __future__ import annotations

import pytest

import json
import time

import torch
import yaml

from conftest import run_on_ranks
from zerotrain.autotuning.search_space import experiments
from zerotrain.planning.ladder import ladder
from zerotrain.planning.rung_memory import GIB, Hardware

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
SEQ, MICRO = 32, 4


def _meta():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=512, **SIZES))


def test_candidates_follow_the_ladder_and_the_memory_model_prunes_what_does_not_fit():
    model = _meta()
    kept, pruned = experiments(model, Hardware(2), SEQ, 8, "fp32", {})
    rung_order = {r: i for i, r in enumerate(ladder(allow_nvme=False))}
    order = [(rung_order[e.rung], -e.micro_batch) for e in kept]
    assert order == sorted(order) and not pruned
    assert all(e.micro_batch * e.accumulation * 2 == 8 for e in kept)
    tight = Hardware(2, gpu_memory=GIB + kept[-1].predicted_gpu_bytes)  # only the leanest candidates fit
    kept_tight, pruned_tight = experiments(model, tight, SEQ, 8, "fp32", {})
    assert pruned_tight and all("GPU needs" in p.reason for p in pruned_tight)
    assert all(e.predicted_gpu_bytes <= kept[-1].predicted_gpu_bytes for e in kept_tight)
    slow, _ = experiments(model, Hardware(2), SEQ, 8, "fp32", {}, fast=False)
    assert {e.reduce_bucket_size for e in slow if e.rung.stage > 0} == {50_000_000, 500_000_000}


def _by_hand(world: int, configs: list[dict]) -> list[float]:
    """Throughput (samples/s) of each DeepSpeed config, timed directly: 2 warm-up steps, then 1 s."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import zerotrain

    out = []
    for ds in configs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=256, **SIZES))
        engine, *_ = zerotrain.initialize(model=model, config=ds)
        micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]

        def step():
            for _ in range(accumulation):
                ids = torch.randint(0, 256, (micro, SEQ))
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()

        step(), step()
        dist.barrier()
        begin, steps = time.perf_counter(), 0
        while True:
            step()
            steps += 1
            took = torch.tensor([time.perf_counter() - begin])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if took.item() >= 1.0:
                break
        out.append(ds["train_batch_size"] * steps / took.item())
        engine.destroy()
    return out


def test_tune_skips_an_oom_on_one_rank_stops_early_and_picks_the_fastest(zerotrain_cli):
    cwd = zerotrain_cli.cwd
    (cwd / "tune.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": "llama", "tokenizer": "byte", "config_overrides": SIZES},
        "data": {"format": "synthetic", "seq_len": SEQ},
        "training": {"micro_batch_size": MICRO, "gradient_accumulation_steps": 1, "precision": "fp32"},
        "zero": {"zero_optimization": {"stage": 2},
                 "autotuning": {"enabled": True, "tuner_early_stopping": 2, "start_profile_step": 2,
                                "end_profile_step": 3, "metric": "throughput"}},
    }))
    started = time.monotonic()
    done = zerotrain_cli("tune", "tune.yaml", "--num_gpus", "2", "--min-trial-seconds", "1", "--trial-timeout", "10",
                         "--repeats", "2", "--json", env={"ZEROTRAIN_FAULT": "trial:rank1:2:oom"}, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert time.monotonic() - started < 180
    report = json.loads(done.stdout[done.stdout.index("{\n"):])
    ran = [r for r in report["records"] if r["status"] != "not run"]
    assert [r["name"] for r in ran] == ["z0_mbs4", "z0_mbs2", "z0_mbs1"]  # the ladder's first, in order
    assert ran[1]["status"] == "oom" and "rank 1" in ran[1]["reason"]  # both ranks skipped it together
    assert all(r["reason"].startswith("early stop") for r in report["records"][3:]), [
        r for r in report["records"][3:] if not r["reason"].startswith("early stop")]
    results = cwd / "autotuning_results"
    assert (results / "summary.txt").is_file() and (cwd / "autotuning_exps" / "z0_mbs4.json").is_file()
    assert json.loads((results / "z0_mbs2" / "metrics.json").read_text())["status"] == "oom"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    best = report["best"]["name"]
    assert report["verdict"]["winner"] == best and len(report["best"]["runs"]) == 2  # both ranks repeated it
    configs = [json.loads((results / r["name"] / "ds_config.json").read_text()) for r in ran if r["status"] == "ok"]
    names = [r["name"] for r in ran if r["status"] == "ok"]
    assert optimal == configs[names.index(best)]
    by_hand = run_on_ranks(2, _by_hand, 2, configs)[0]
    assert by_hand[names.index(best)] >= 0.9 * max(by_hand), dict(zip(names, by_hand))
