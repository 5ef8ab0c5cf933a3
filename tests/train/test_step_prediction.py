"""`zerotrain train` compares its first timed steps with the step-time model's prediction, once."""

from __future__ import annotations

import json

import pytest

from zerotrain.train.step_prediction import comparison

PROBE = {"kind": "zerotrain-bench-compute", "version": 1, "device": "cpu (test)", "device_type": "cpu",
         "matmul_tflops": 0.01, "cpu_adam_elements_per_s": 2e8, "device_adam_elements_per_s": 2e8}


@pytest.mark.slow  # a whole two-rank run; the missing-probe case below keeps the area in `make check`
def test_a_run_with_a_compute_probe_says_measured_against_predicted_once(zerotrain_cli):
    probe = zerotrain_cli.cwd / "compute.json"
    probe.write_text(json.dumps(PROBE))
    # Three logging windows: the warm-up, the one compared, and one more that must not repeat the line.
    # Nothing here reads an evaluation, a checkpoint or much data: none is made (the default job has all three).
    done = zerotrain_cli("train", "--training.max_steps", "6", "--logging.interval", "2", "--logging.compute_probe",
                         "compute.json", "--output.dir", "run", "--output.export_hf", "false", "--output.save_final",
                         "false", "--training.eval_interval", "0", "--data.synthetic.num_examples", "400", check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("step time: measured")]
    assert len(lines) == 1 and "predicted" in lines[0] and "compute-bound" in lines[0], done.stdout[-3000:]
    saved = json.loads((zerotrain_cli.cwd / "run" / "predicted_step.json").read_text())
    assert saved["world_size"] == 2 and saved["step_s"] > 0 and saved["rung"].startswith("stage")
    assert any("bench compute" in s for s in saved["speeds"]) and not any("H100" in s for s in saved["speeds"])
    # The saved config names the probe by its absolute path: the printed resume works from anywhere.
    assert str(probe) in (zerotrain_cli.cwd / "run" / "config.yaml").read_text()


def test_a_probe_that_is_not_there_fails_before_any_rank_starts(zerotrain_main):
    # Refused before any rank starts: in this process, without a fresh interpreter's start-up.
    done = zerotrain_main("train", "--logging.compute_probe", "nope.json", "--output.dir", "run")
    assert done.returncode == 2 and "nope.json" in done.stderr and "bench compute" in done.stderr
    assert not (zerotrain_main.cwd / "run").exists()


def test_a_large_gap_says_where_to_look():
    prediction = {"step_s": 1.0, "bottleneck": "compute-bound: forward and backward take 90% of the step"}
    assert "bench comm" in comparison(1.8, prediction) and "1.80x" in comparison(1.8, prediction)
    assert "bench compute" in comparison(0.5, prediction)
    assert "bench" not in comparison(1.2, prediction)
