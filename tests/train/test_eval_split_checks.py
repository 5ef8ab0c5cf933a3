"""Data too small for the ranks is found before any rank starts; with evaluation off
(training.eval_interval 0) the evaluation data never stops a run. A command refused before any rank
starts runs in this process (`zerotrain_main`: the same parser and checks, no fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import device_env

pytestmark = pytest.mark.slow  # starts `zerotrain train`

TOO_FEW_FOR_EVAL = "the eval data packs into 1 sequence(s)"


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def _train_on(cli, tmp_path: Path, *args) -> subprocess.CompletedProcess:
    """Two CPU ranks on a train file of 60 short documents and an eval file of one, plus `args`, through
    `cli` (the console script or this process)."""
    train = _jsonl(tmp_path / "train.jsonl", [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(60)])
    held_out = _jsonl(tmp_path / "eval.jsonl", ["a single short evaluation document"])  # 1 sequence: fewer than 2 ranks
    return cli(
        "train", "--nproc_per_node", "2", "--output.dir", tmp_path / "runs" / "r", "--data.cache_dir", tmp_path / "cache",
        "--data.path", train, "--data.eval_path", held_out, "--data.format", "jsonl", "--training.max_steps", "1",
        "--training.micro_batch_size", "1", "--output.export_hf", "false", "--output.save_final", "false", *args,
        env=device_env("cpu"),
    )


def test_with_evaluation_off_an_eval_split_too_small_for_the_ranks_does_not_stop_training(zerotrain_cli, tmp_path):
    done = _train_on(zerotrain_cli, tmp_path, "--training.eval_interval", "0")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert TOO_FEW_FOR_EVAL not in out
    assert json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["steps"] == 1


def test_with_evaluation_on_an_eval_split_too_small_fails_once_before_any_rank_starts(zerotrain_main, tmp_path):
    done = _train_on(zerotrain_main, tmp_path, "--training.eval_interval", "1")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count(TOO_FEW_FOR_EVAL) == 1, out[-3000:]
    assert "fewer than the 2 rank(s)" in out and "training.eval_interval: 0" in out
    assert "zerotrain launch" not in out and "rank 0" not in out  # no rank was started
    assert not (tmp_path / "runs").exists()  # nor anything written


def test_a_training_split_too_small_for_the_ranks_fails_before_any_rank_starts(zerotrain_main, tmp_path):
    tiny = _jsonl(tmp_path / "tiny.jsonl", ["one short document"])
    done = zerotrain_main(
        "train", "--nproc_per_node", "2", "--output.dir", tmp_path / "runs" / "t", "--data.cache_dir", tmp_path / "cache",
        "--data.path", tiny, "--data.format", "jsonl", "--data.eval_fraction", "0", env=device_env("cpu"),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count("the training data packs into 1 sequence(s)") == 1 and "fewer than the 2 rank(s)" in out, out[-3000:]
    assert "zerotrain launch" not in out and not (tmp_path / "runs").exists()
