"""Built-in `--workload` configs: each loads and resolves as the trainer does, with a model of about the
size its name says; llama-cpu, on short sequences, trains end to end from `zerotrain bench run` on two
loopback sshd nodes (127.0.0.45, .46)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from zerotrain.bench.workloads import WORKLOADS, UnknownWorkloadError, workload_config, workload_target
from zerotrain.train.config_files import load_train_config
from zerotrain.train.data import load_tokenizer
from zerotrain.train.model import build_model
from zerotrain.train.zero_fill import build_engine_config

NOMINAL = {"llama-cpu": 17e6, "llama-125m": 125e6, "llama-350m": 350e6, "llama-1b": 1e9}
STEPS = {"llama-cpu": 20}  # the others: 30


@pytest.mark.slow
@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_config_resolves_to_a_llama_of_its_named_size(name):
    cfg = load_train_config(workload_config(name))
    assert cfg.model.architecture == "llama" and cfg.data.format == "synthetic"
    assert cfg.training.max_steps == STEPS.get(name, 30) and cfg.training.eval_interval == 0
    assert cfg.logging.csv and not cfg.output.export_hf
    with torch.device("meta"):  # the model the trainer builds, without allocating it
        model = build_model(cfg.model, load_tokenizer(cfg.model.tokenizer, None))
    params = sum(p.numel() for p in model.parameters())
    assert 0.85 * NOMINAL[name] <= params <= 1.15 * NOMINAL[name], f"{name}: {params / 1e6:.0f}M parameters"
    engine, _ = build_engine_config(cfg, model=model, world_size=2, device_type="cpu",
                                    total_steps=cfg.training.max_steps)
    assert engine.train_micro_batch_size_per_gpu == cfg.training.micro_batch_size
    assert engine.zero_optimization.stage == 2


def test_workload_target_runs_zerotrain_train_as_a_launched_module(tmp_path):
    target = workload_target("llama-350m", tmp_path / "batch-001")
    assert target == ["--no_local_rank", "--module", "zerotrain", "train", str(workload_config("llama-350m")),
                      "--output.dir", str(tmp_path / "batch-001" / "train")]
    assert Path(target[4]).is_file()


def test_unknown_workload_lists_the_built_in_names(tmp_path):
    with pytest.raises(UnknownWorkloadError) as error:
        workload_target("llama-7b", tmp_path)
    assert "'llama-7b'" in str(error.value) and "llama-cpu, llama-125m, llama-350m, llama-1b" in str(error.value)


def test_llama_cpu_is_sized_for_a_few_seconds_a_step_on_two_cores():
    # ~0.4 TFLOP a step (6 x parameters x tokens): a few seconds at the 0.1-0.2 TFLOP/s of 2 cores in fp32.
    cfg = load_train_config(workload_config("llama-cpu"))
    with torch.device("meta"):
        model = build_model(cfg.model, load_tokenizer(cfg.model.tokenizer, None))
    tokens = cfg.data.seq_len * cfg.training.micro_batch_size * cfg.training.gradient_accumulation_steps
    flop = 6 * sum(p.numel() for p in model.parameters()) * tokens
    assert 0.2e12 <= flop <= 0.8e12, f"{flop / 1e12:.2f} TFLOP a step"
    assert cfg.training.precision == "auto"  # fp32 on a CPU


@pytest.mark.slow
def test_llama_cpu_workload_trains_on_two_nodes_from_the_bench_command_and_reports_its_throughput(
        make_ssh_nodes, zerotrain_cli, tmp_path):
    # One bench job on two nodes: the built-in workload through the form `zerotrain bench run` launches
    # (workload_target, as test_run.py's dry run shows), trained end to end on both, and its report.
    cluster = make_ssh_nodes(["127.0.0.45", "127.0.0.46"])
    hostfiles = tmp_path / "hostfiles"
    hostfiles.mkdir()
    (hostfiles / "batch-001").write_text("127.0.0.45 slots=1\n127.0.0.46 slots=1\n")
    # The documented form, 2 steps instead of 20: the first row includes start-up, the report uses the second.
    # Short sequences and less generated data: the workload's model (its parameter count, below) is unchanged,
    # but a step takes a fraction of a second instead of ~3 s of 2 cores (its sizing is checked above).
    done = zerotrain_cli("bench", "run", hostfiles, "--timeout", "240", "--out", "run", "--ssh_args", cluster.ssh_args,
                         "--env", f"ZEROTRAIN_CACHE={tmp_path / 'cache'}", "--workload", "llama-cpu",
                         "--", "--training.max_steps", "2", "--logging.interval", "1", "--data.seq_len", "64",
                         "--training.micro_batch_size", "2", "--data.synthetic.num_examples", "2000", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = zerotrain_cli.cwd / "run" / "batch-001"
    log = (job / "log.txt").read_text()
    assert "16,913,280 parameters" in log and "job finished on 2 nodes (2 ranks)" in log, log[-3000:]
    with (job / "train" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [1, 2]
    assert all(float(r["samples_per_s"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows)
    assert not (job / "train" / "hf").exists()  # the workload exports no model
    report = zerotrain_cli("bench", "report", "run", "--threshold", "0.01")
    assert report.returncode == 0 and "1 of 1 jobs passed" in report.stdout, report.stdout + report.stderr
