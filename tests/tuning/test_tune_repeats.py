"""`zerotrain tune` as a user runs it (the console script, from a temp folder), on one CPU rank and a
tiny Llama: the leaders are repeated and the table shows each trial's median and spread, the
verdict never claims a lead inside the noise, the winner is printed as train YAML overrides that
load, library warnings go to the trial's log file and not the console, and a failed trial shows
its first error line."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

pytestmark = pytest.mark.slow  # starts the tune job's processes

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 32, "vocab_size": 260}


def _write_yaml(cwd, **autotuning) -> None:
    (cwd / "tune.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": "llama", "tokenizer": "byte", "config_overrides": TINY},
        "data": {"format": "synthetic", "seq_len": 16},
        "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "precision": "fp32"},
        "zero": {"zero_optimization": {"stage": 2},
                 "autotuning": {"enabled": True, "tuner_num_trials": 3, "start_profile_step": 2,
                                "end_profile_step": 3, "metric": "throughput", **autotuning}},
    }))


def test_tune_repeats_the_leaders_shows_spreads_and_prints_the_overrides(zerotrain_cli):
    from zerotrain.train.config_files import load_train_config

    cwd = zerotrain_cli.cwd
    _write_yaml(cwd)
    # Trials: z0_mbs2, z0_mbs1 (made to fail), z0_sac_mbs2 (selective gradient checkpointing).
    done = zerotrain_cli("tune", "tune.yaml", "--repeats", "2", "--min-trial-seconds", "0.2",
                         env={"ZEROTRAIN_FAULT": "trial:rank0:2:fail"}, timeout=120)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "Warning" not in out + done.stderr and "warnings.warn" not in done.stderr, done.stderr[-2000:]
    results = cwd / "autotuning_results"
    assert (results / "z0_sac_mbs2" / "stderr.log").is_file()  # each trial's output goes to its own log

    # The failed trial: its first error line on the console, the traceback in its log.
    failed = r"^trial 2/\d+ z0_mbs1: failed rank 0: ValueError: injected failure \(by a test\) "
    assert re.search(failed, out, re.M), out
    assert "second line" not in out and "Traceback" in (results / "z0_mbs1" / "stderr.log").read_text()

    # Leader and runner-up ran twice: the table gives each a median and a min-max spread.
    assert len(re.findall(r"^repeat 2/2 ", out, re.M)) == 2, out
    assert "spread (min-max)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("z0_mbs2 ", "z0_sac_mbs2 "))}
    assert all(re.search(r" ok +[\d.]+ +[\d.]+-[\d.]+ \(\+-\d+%\)", row) for row in rows.values()), rows
    verdict = next(line for line in out.splitlines() if "within noise (spreads overlap)" in line
                   or line.startswith("Winner "))
    assert "outside both spreads" in verdict or "pick either" in verdict, verdict

    # The winner as train YAML keys, and the same as `zerotrain train` flags that load to the winner.
    best = next(name for name, row in rows.items() if "<- best" in row)
    micro = 2 if best != "z0_mbs1" else 1
    assert f"  training.micro_batch_size: {micro}" in out and "  zero.zero_optimization.stage: 0" in out
    assert f"  training.gradient_checkpointing: {'selective' if 'sac' in best else 'false'}" in out
    command = next(line for line in out.splitlines() if "zerotrain train tune.yaml" in line).split(": ", 1)[1]
    cfg = load_train_config(cwd / "tune.yaml", shlex.split(command)[3:])
    assert cfg.training.micro_batch_size == micro and cfg.zero_dict()["zero_optimization"]["stage"] == 0
    assert "ds_config_optimal.json" in out


def test_tune_refuses_to_overwrite_before_any_trial(zerotrain_cli):
    cwd = zerotrain_cli.cwd
    _write_yaml(cwd, overwrite=False)
    (cwd / "autotuning_results").mkdir()
    (cwd / "autotuning_results" / "summary.txt").write_text("earlier\n")
    done = zerotrain_cli("tune", "tune.yaml", timeout=60)
    assert done.returncode == 2 and "overwrite is false" in done.stderr, done.stdout + done.stderr
    assert "trial 1" not in done.stdout
