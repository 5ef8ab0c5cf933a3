"""Built-in `--workload` configs: each loads and resolves as the trainer does, with a model of about the
size its name says; one made tiny trains end to end through the form `zerotrain bench run` launches, on
two loopback sshd nodes (127.0.0.21, .22)."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest
import torch

from zerotrain.bench.workloads import WORKLOADS, UnknownWorkloadError, workload_config, workload_target
from zerotrain.train.config_files import load_train_config
from zerotrain.train.data import load_tokenizer
from zerotrain.train.model import build_model
from zerotrain.train.zero_fill import build_engine_config

from conftest import zerotrain_script
from free_ports import free_port

NOMINAL = {"llama-cpu": 17e6, "llama-125m": 125e6, "llama-350m": 350e6, "llama-1b": 1e9}
STEPS = {"llama-cpu": 20}  # the others: 30
TINY = ["--model.config_overrides.hidden_size", "32", "--model.config_overrides.intermediate_size", "64",
        "--model.config_overrides.num_hidden_layers", "2", "--model.config_overrides.num_attention_heads", "2",
        "--model.config_overrides.num_key_value_heads", "2", "--model.config_overrides.vocab_size", "512",
        "--data.seq_len", "64", "--data.synthetic.num_examples", "2000", "--training.micro_batch_size", "2",
        "--training.warmup_steps", "0", "--training.max_steps", "3", "--logging.interval", "1"]


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
def test_llama_cpu_workload_runs_from_the_bench_command_and_reports_its_throughput(make_ssh_nodes, zerotrain_cli,
                                                                                   tmp_path):
    cluster = make_ssh_nodes(["127.0.0.45"])
    hostfiles = tmp_path / "hostfiles"
    hostfiles.mkdir()
    (hostfiles / "batch-001").write_text("127.0.0.45 slots=1\n")
    # The documented form, 2 steps instead of 20: the first row includes start-up, the report uses the second.
    done = zerotrain_cli("bench", "run", hostfiles, "--timeout", "240", "--out", "run", "--ssh_args", cluster.ssh_args,
                         "--env", f"ZEROTRAIN_CACHE={tmp_path / 'cache'}", "--workload", "llama-cpu",
                         "--", "--training.max_steps", "2", "--logging.interval", "1", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = zerotrain_cli.cwd / "run" / "batch-001"
    assert "16,913,280 parameters" in (job / "log.txt").read_text()
    with (job / "train" / "metrics.csv").open() as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [1, 2]
    report = zerotrain_cli("bench", "report", "run", "--threshold", "0.01")
    assert report.returncode == 0 and "1 of 1 jobs passed" in report.stdout, report.stdout + report.stderr


@pytest.mark.slow
def test_tiny_workload_trains_on_two_nodes_and_writes_throughput(make_ssh_nodes, tmp_path):
    cluster = make_ssh_nodes(["127.0.0.21", "127.0.0.22"])
    job_dir = tmp_path / "run" / "batch-000"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    argv = [zerotrain_script(), "launch", "--hostfile", str(cluster.hostfile(slots=1)), "--ssh_args", cluster.ssh_args,
            "--master_port", str(free_port("127.0.0.21")), "--env", f"ZEROTRAIN_CACHE={tmp_path / 'cache'}",
            *workload_target("llama-125m", job_dir), *TINY]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "job finished on 2 nodes (2 ranks)" in done.stderr
    with (job_dir / "train" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(float(r["samples_per_s"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows)
    assert not (job_dir / "train" / "hf").exists()
