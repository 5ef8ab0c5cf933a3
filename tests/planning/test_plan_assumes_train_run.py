"""`estimate`/`plan` of a train YAML describe the job `zerotrain train` runs from it on this machine (its
ranks, its precision, its batch), say so on one "assumed:" line, and let explicit flags win; `plan --scale`
needs no --gpus; a GPU named by its memory is found however the memory is written."""

from __future__ import annotations

import json

import pytest
import yaml

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
OVERRIDES = [t for k, v in TINY.items() for t in ("--config-override", f"{k}={v}")]


def _write_run(folder, **training) -> str:
    (folder / "run.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": "llama", "tokenizer": "byte", "config_overrides": TINY},
        "data": {"format": "synthetic", "seq_len": 64},
        "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 3, **training},
    }))
    return str(folder / "run.yaml")


def _what_train_uses(path: str) -> tuple[int, str]:
    """The processes `zerotrain train PATH` starts here and the precision it trains in: train's own code."""
    from zerotrain.comm.distributed import device_for
    from zerotrain.train.command import local_process_count
    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.zero_fill import resolve_precision

    cfg = load_train_config(path)
    return local_process_count(), resolve_precision(cfg.training.precision, device_for(0).type, cfg.zero_dict())


def _run(capsys, *argv) -> tuple[int, str]:
    """A planning command in this process (the console script's parser and handler): (exit, stdout)."""
    from zerotrain.cli.main import build_parser

    args = build_parser().parse_args([str(a) for a in argv])
    code = args.handler(args)
    return code, capsys.readouterr().out


@pytest.mark.slow  # the console script: a fresh process
def test_estimate_of_a_train_yaml_assumes_the_ranks_and_precision_train_uses_here(zerotrain_cli):
    # HEAD assumed 1 GPU in bf16 while `zerotrain train run.yaml` started 2 CPU ranks in fp32.
    _write_run(zerotrain_cli.cwd)
    world, precision = _what_train_uses(str(zerotrain_cli.cwd / "run.yaml"))
    data = json.loads(zerotrain_cli("estimate", "run.yaml", "--json", check=True).stdout)
    assert (data["hardware"]["gpus_per_node"], data["hardware"]["nodes"]) == (world, 1)
    # the model's sequence and micro-batch from the YAML, in a fresh process: no import-order luck
    assert (data["workload"]["seq_len"], data["workload"]["micro_batch"]) == (64, 2)
    assert data["workload"]["dtype"] == precision
    import torch

    ranks = f"{world} GPUs" if torch.cuda.is_available() else f"{world} CPU ranks"
    assert data["assumed"] == [f"assumed: {ranks} (what `zerotrain train` starts here), {precision} (precision: auto "
                               f"{'on a GPU' if torch.cuda.is_available() else 'on CPU'})"]


def test_explicit_flags_win_over_what_train_would_use(tmp_path, capsys):
    path = _write_run(tmp_path)
    code, out = _run(capsys, "estimate", path, "--gpus-per-node", "3", "--dtype", "bf16", "--json")
    data = json.loads(out)
    assert code == 0 and data["hardware"]["gpus_per_node"] == 3 and data["workload"]["dtype"] == "bf16"
    assert data["assumed"] == []
    code, out = _run(capsys, "estimate", path, "--gpus-per-node", "3")  # the precision alone comes from train
    world, precision = _what_train_uses(path)
    assert code == 0 and f"assumed: {precision} (precision: auto" in out and "starts here" not in out


def test_a_train_yamls_precision_is_taken_as_written(tmp_path, capsys):
    path = _write_run(tmp_path, precision="fp16")
    code, out = _run(capsys, "estimate", path, "--json")
    data = json.loads(out)
    assert data["workload"]["dtype"] == "fp16" and data["assumed"][0].endswith("fp16 (precision: fp16)")


def test_plan_of_a_train_yaml_plans_the_ranks_and_global_batch_train_runs(tmp_path, capsys):
    path = _write_run(tmp_path)
    world, precision = _what_train_uses(path)
    code, out = _run(capsys, "plan", path, "--gpu-memory", "2GiB", "--cpu-memory", "64GiB", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["hardware"]["world_size"] == world
    assert plan["global_batch"] == 2 * 3 * world  # micro-batch x accumulation x ranks, as train steps
    assert plan["assumed"][0].startswith(f"assumed: {world} ") and f"{precision} (precision: auto" in plan["assumed"][0]
    assert f"global batch {2 * 3 * world}" in plan["assumed"][0]
    code, out = _run(capsys, "plan", path, "--gpus", "4", "--global-batch", "8", "--dtype", "bf16",
                     "--gpu-memory", "2GiB", "--cpu-memory", "64GiB", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["hardware"]["world_size"] == 4 and plan["global_batch"] == 8 and plan["assumed"] == []


def test_plan_scale_takes_its_gpu_counts_from_the_list(capsys):
    # HEAD: "say how many GPUs: --gpus N" although --scale 2,4 gives them.
    code, out = _run(capsys, "plan", "llama", *OVERRIDES, "--gpu-memory", "2GiB", "--cpu-memory", "64GiB",
                     "--seq-len", "64", "--global-batch", "16", "--scale", "2,4", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["hardware"]["world_size"] == 2
    assert plan["assumed"] == ["assumed: --gpus 2, the smallest --scale count (the plan is made there)"]
    assert [p["gpus"] for p in plan["scale"][0]["points"]] == [2, 4]


def test_a_gpu_memory_written_in_gb_is_read_as_gb_and_the_plan_says_what_that_is(capsys):
    code, out = _run(capsys, "estimate", "llama", *OVERRIDES, "--gpu-memory", "80GB")
    assert code == 0 and "GPU memory: 80GB is 80e9 bytes = 74.5 GiB" in out and "write --gpu-memory 80GiB" in out
    assert "x 74.5 GiB" in out
    _, out = _run(capsys, "estimate", "llama", *OVERRIDES, "--gpu-memory", "80GiB")
    assert "GPU memory:" not in out and "x 80.0 GiB" in out


@pytest.mark.parametrize(("gpu_memory", "device"), [
    (80 * 10**9, "h100"), (80 * 2**30, "h100"), (85_031_714_816, "h100"),  # 80GB, 80GiB, what torch reports
    (141 * 10**9, "h200"), (143_771 * 2**20, "h200"),  # an H200 as nvidia-smi reports it: 140.4 GiB
    (40 * 10**9, "a100-40gb"), (32 * 2**30, "v100"), (64 * 2**30, None),
])
def test_a_gpu_is_named_by_its_memory_however_the_memory_is_written(gpu_memory, device):
    import argparse

    from zerotrain.planning.speed_args import rates_from_args

    flags = argparse.Namespace(gpu=None, gpu_memory=gpu_memory, intra_node=None, inter_node=None, compute=None,
                               comm=None)
    _, assumed = rates_from_args(flags, 8)
    said = f"GPU speed: {device} (from --gpu-memory" if device else "GPU speed: h100 (give --gpu to say which)"
    assert assumed[0].startswith(said), assumed
