"""A run folder never loses work: re-runs, resume targets, pruning, live runs, Ctrl-C, detach.

Every case runs the installed `zerotrain` console script from a temporary folder, a fresh
process per run, as a user does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import zerotrain_script

# A short single-process job: tiny data, no evaluation, no HF export (each run takes seconds).
FAST = ["--nproc_per_node", "1", "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400",
        "--training.eval_interval", "0", "--logging.interval", "1", "--output.export_hf", "false"]


def _train(cli, run: Path, *args, check: bool = True, timeout: float = 300.0):
    cache = run.parent / "cache"
    return cli("train", "--output.dir", run, "--data.cache_dir", cache, *FAST, *args, check=check, timeout=timeout)


def _tags(run: Path) -> list[str]:
    return sorted((p.name for p in (run / "checkpoints").glob("step*")), key=lambda name: int(name[4:]))


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


@pytest.mark.slow
def test_rerun_into_a_folder_that_holds_a_run_is_refused_until_resume_or_overwrite(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    _train(zerotrain_cli, run, "--training.max_steps", "2")
    before = (run / "metrics.csv").read_text()

    again = _train(zerotrain_cli, run, "--training.max_steps", "2", check=False)
    assert again.returncode == 2
    assert str(run) in again.stderr and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr
    assert (run / "metrics.csv").read_text() == before and _latest(run) == "step2"  # untouched

    _train(zerotrain_cli, run, "--training.max_steps", "4", "--resume")
    assert _latest(run) == "step4"
    overwritten = _train(zerotrain_cli, run, "--training.max_steps", "1", "--overwrite")
    assert "removed the earlier run" in overwritten.stderr
    assert _tags(run) == ["step1"] and _latest(run) == "step1"


@pytest.mark.slow
def test_pruning_keeps_an_earlier_runs_higher_tags_and_never_the_latest(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    _train(zerotrain_cli, run, "--training.max_steps", "8", "--training.save_interval", "2",
           "--output.keep_checkpoints", "null")
    assert _tags(run) == ["step2", "step4", "step6", "step8"]
    # Go back to step 2 (a tag folder) and train to 6 keeping 2: only tags this run wrote may go.
    _train(zerotrain_cli, run, "--training.max_steps", "6", "--training.save_interval", "2",
           "--output.keep_checkpoints", "2", "--training.resume", run / "checkpoints" / "step2")
    assert _latest(run) == "step6"
    assert _tags(run) == ["step4", "step6", "step8"]  # step2 (resumed from) pruned; step8 is not this run's
    consolidated = zerotrain_cli("consolidate", run / "checkpoints", tmp_path / "out.safetensors")
    assert consolidated.returncode == 0, consolidated.stderr


@pytest.mark.slow
@pytest.mark.parametrize("target", ["missing", "file", "no_latest"])
def test_a_resume_target_that_is_not_a_checkpoint_fails_before_any_step(zerotrain_cli, tmp_path, target):
    run = tmp_path / "run"
    bad = {"missing": tmp_path / "nope", "file": tmp_path / "file.txt", "no_latest": tmp_path / "empty"}[target]
    if target == "file":
        bad.write_text("x")
    elif target == "no_latest":
        bad.mkdir()
    proc = _train(zerotrain_cli, run, "--training.max_steps", "2", "--training.resume", bad, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(bad) in proc.stderr and "training.resume" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()


@pytest.mark.slow
def test_the_saved_config_resumes_from_any_folder_with_relative_paths_made_absolute(zerotrain_cli, tmp_path):
    # Relative paths used to stay relative in RUN/config.yaml: the printed resume command failed
    # (or wrote a stray run) from any other folder.
    start = zerotrain_cli.cwd
    common = ["--data.cache_dir", "cache", *FAST, "--training.save_interval", "2"]
    zerotrain_cli("train", "--output.dir", "runs/rel", *common, "--training.max_steps", "2", check=True)
    saved = (start / "runs" / "rel" / "config.yaml").read_text()
    assert f"dir: {start / 'runs' / 'rel'}" in saved and f"cache_dir: {start / 'cache'}" in saved, saved
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    zerotrain_cli("train", start / "runs" / "rel" / "config.yaml", "--resume", "--training.max_steps", "4",
                  cwd=elsewhere, check=True)
    assert _latest(start / "runs" / "rel") == "step4" and not (elsewhere / "runs").exists()


def test_resume_with_no_checkpoint_fails_before_any_rank_starts_naming_the_folder(zerotrain_cli, tmp_path):
    # It used to start a new run from step 0 and exit 0. Not slow: it ends before any rank starts.
    run = tmp_path / "run"
    proc = _train(zerotrain_cli, run, "--training.max_steps", "2", "--resume", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing to resume" in proc.stderr and str(run / "checkpoints") in proc.stderr, proc.stderr
    assert "training.resume: auto" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists(), "nothing is written"


@pytest.mark.slow
def test_a_foreground_run_refuses_a_folder_with_a_live_run(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / "train.pid").write_text(f"{live.pid}\n")
        proc = _train(zerotrain_cli, run, "--training.max_steps", "1", check=False)
        assert proc.returncode == 2
        assert str(live.pid) in proc.stderr and "zerotrain stop" in proc.stderr
        assert (run / "train.pid").read_text().strip() == str(live.pid)  # not deleted
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
def test_resume_with_another_global_batch_or_schedule_says_old_and_new(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    _train(zerotrain_cli, run, "--training.max_steps", "2")
    proc = _train(zerotrain_cli, run, "--resume", "--training.max_steps", "4", "--training.micro_batch_size", "8")
    said = proc.stdout + proc.stderr
    assert "global batch (samples per step): 4 → 8" in said
    assert "total steps: 2 → 4" in said


def _interrupt(run: Path, nproc: int, sig: signal.Signals, whole_group: bool, cwd: Path) -> tuple[int, str, str]:
    """Starts a long run, waits for its first metrics, sends `sig`; returns (status, stdout, stderr)."""
    args = [zerotrain_script(), "train", "--output.dir", str(run), "--data.cache_dir", str(run.parent / "cache"),
            *FAST, "--nproc_per_node", str(nproc), "--training.max_steps", "100000", "--training.save_interval", "0"]
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 200
        while not (run / "metrics.csv").exists() or len((run / "metrics.csv").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.3)
        if whole_group:
            os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal does: every process of the job gets it
        else:
            proc.send_signal(sig)  # e.g. `kill PID` or a scheduler's pre-emption notice
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


@pytest.mark.parametrize(
    ("nproc", "sig", "whole_group"),
    [(1, signal.SIGINT, True), (2, signal.SIGINT, True), (2, signal.SIGTERM, False)],
    ids=["ctrl_c-1-process", "ctrl_c-2-processes", "sigterm-2-processes"],
)
@pytest.mark.slow
def test_ctrl_c_or_sigterm_saves_the_current_step_and_says_how_to_resume(tmp_path, nproc, sig, whole_group):
    run = tmp_path / "run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    code, out, err = _interrupt(run, nproc, sig, whole_group, cwd)
    assert code == 130, out[-2000:] + err[-3000:]
    lines = [line for line in (out + err).splitlines() if "stopped at step" in line]
    assert len(lines) == 1 and "--resume" in lines[0], out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err
    step = int(lines[0].split("stopped at step ")[1].split()[0])
    assert _latest(run) == f"step{step}" and step >= 2


@pytest.mark.slow
def test_detach_reports_started_only_once_the_ranks_are_up(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    proc = _train(zerotrain_cli, run, "--nproc_per_node", "2", "--training.max_steps", "100000",
                  "--training.save_interval", "0", "--detach")
    try:
        assert proc.stdout.startswith("started in the background"), proc.stdout + proc.stderr
        assert (run / "train.started").exists()  # written by rank 0 once every engine is built
    finally:
        stop = zerotrain_cli("stop", run, timeout=200)
        assert stop.returncode == 0, stop.stderr


@pytest.mark.slow
def test_detach_of_a_run_that_dies_at_start_shows_its_error_and_fails(zerotrain_cli, tmp_path):
    run = tmp_path / "run"
    # Valid config, but the model cannot be built: the run dies after it was detached.
    proc = _train(zerotrain_cli, run, "--model.config_overrides.num_attention_heads", "3", "--detach", check=False)
    assert proc.returncode != 0
    assert "started in the background" not in proc.stdout
    assert str(run / "train.log") in proc.stderr and "num_attention_heads" in proc.stderr


def test_printed_commands_are_shell_quoted_for_a_run_folder_with_a_space(tmp_path):
    # Pasted as printed, each used to split at the space.
    import re
    import shlex

    from zerotrain.train.run_folder import RunFolderError, check_can_start, require_checkpoint_to_resume

    run = tmp_path / "my run"
    run.mkdir()
    (run / "metrics.csv").write_text("step\n1\n")
    config = str(run / "config.yaml")
    with pytest.raises(RunFolderError) as refused:
        check_can_start(run, "never", False, config)
    with pytest.raises(RunFolderError) as nothing:
        require_checkpoint_to_resume(run, config)
    for message in (str(refused.value), str(nothing.value)):
        commands = re.findall(r"`(zerotrain train [^`]*)`", message)
        assert commands and all(shlex.split(c)[:3] == ["zerotrain", "train", config] for c in commands), message
