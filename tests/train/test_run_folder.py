"""A run folder never loses work: re-runs, resume targets, pruning, live runs, Ctrl-C, detach.

Every run that trains goes through the installed `zerotrain` console script from a temporary folder,
a fresh process per run, as a user does; a command that starts no rank here (refused, consolidate, a
detached start) runs in this process (`zerotrain_main`: the same parser and checks, without a fresh
interpreter's start-up).
Four tests share one folder's history of re-runs (`rerun`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ZerotrainCLI, ZerotrainInProcess, zerotrain_script

# A short single-process job: tiny data, no evaluation, no HF export (each run takes seconds).
FAST = ["--nproc_per_node", "1", "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400",
        "--training.eval_interval", "0", "--logging.interval", "1", "--output.export_hf", "false"]


def _train(cli, run: Path, *args, check: bool = True):
    """`zerotrain train` of the FAST job into `run` through `cli` (a ZerotrainCLI or ZerotrainInProcess)."""
    cache = run.parent / "cache"
    return cli("train", "--output.dir", run, "--data.cache_dir", cache, *FAST, *args, check=check)


def _tags(run: Path) -> list[str]:
    return sorted((p.name for p in (run / "checkpoints").glob("step*")), key=lambda name: int(name[4:]))


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


@dataclass
class Rerun:
    """One run folder taken through a user's second go at it, in the order a user goes (each step
    starts `zerotrain train` afresh): what each step printed and what the folder held after it."""

    cwd: Path
    run: Path
    elsewhere: Path
    config_after_first: str
    metrics_after_first: str
    again: subprocess.CompletedProcess
    metrics_after_again: str
    latest_after_again: str
    resumed: subprocess.CompletedProcess
    latest_after_resume: str
    tags_after_resume: list[str]
    latest_after_prune: str
    tags_after_prune: list[str]
    consolidated: subprocess.CompletedProcess
    overwritten: subprocess.CompletedProcess
    tags_after_overwrite: list[str]
    latest_after_overwrite: str


@pytest.fixture(scope="module")
def rerun(tmp_path_factory) -> Rerun:
    """Shared by four tests (6 commands instead of 11): train 2 steps into `runs/rel` (relative paths,
    every checkpoint kept), the same command again (refused), `--resume` to step 8 from another folder
    through the saved config.yaml with a micro batch of 8 instead of 4, back to step 2 (a tag folder)
    and on to 6 keeping 2, consolidate those checkpoints, then `--overwrite` with 1 step. The refused
    command and consolidate start no rank: they run in this process."""
    root = tmp_path_factory.mktemp("rerun")
    cwd, elsewhere = root / "cwd", root / "elsewhere"
    cwd.mkdir()
    elsewhere.mkdir()
    cli = ZerotrainCLI(cwd)
    run = cwd / "runs" / "rel"
    cli("train", "--output.dir", "runs/rel", "--data.cache_dir", "cache", *FAST, "--training.save_interval", "2",
        "--training.max_steps", "2", "--output.keep_checkpoints", "null", check=True)
    config_after_first, metrics_after_first = (run / "config.yaml").read_text(), (run / "metrics.csv").read_text()
    # the absolute path this time: the refusal must name it
    with pytest.MonkeyPatch.context() as patch:
        again = ZerotrainInProcess(cwd, patch)("train", "--output.dir", run, "--data.cache_dir", cwd / "cache", *FAST,
                                               "--training.max_steps", "2")
    metrics_after_again, latest_after_again = (run / "metrics.csv").read_text(), _latest(run)
    # --nproc_per_node is a launch flag, not in config.yaml: 1 process again, so only the micro batch changes
    resumed = cli("train", run / "config.yaml", "--resume", "--nproc_per_node", "1", "--training.max_steps", "8",
                  "--training.micro_batch_size", "8", cwd=elsewhere, check=True)
    latest_after_resume, tags_after_resume = _latest(run), _tags(run)
    # Go back to step 2 (a tag folder) and train to 6 keeping 2: only tags this run wrote may go.
    cli("train", "--output.dir", run, "--data.cache_dir", cwd / "cache", *FAST, "--training.max_steps", "6",
        "--training.save_interval", "2", "--output.keep_checkpoints", "2", "--training.resume",
        run / "checkpoints" / "step2", check=True)
    latest_after_prune, tags_after_prune = _latest(run), _tags(run)
    with pytest.MonkeyPatch.context() as patch:  # reads files, starts no rank: in this process
        consolidated = ZerotrainInProcess(cwd, patch)("consolidate", run / "checkpoints", root / "out.safetensors")
    overwritten = cli("train", "--output.dir", run, "--data.cache_dir", cwd / "cache", *FAST,
                      "--training.max_steps", "1", "--overwrite", check=True)
    return Rerun(cwd, run, elsewhere, config_after_first, metrics_after_first, again, metrics_after_again,
                 latest_after_again, resumed, latest_after_resume, tags_after_resume, latest_after_prune,
                 tags_after_prune, consolidated, overwritten, _tags(run), _latest(run))


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets `rerun` up: 6 commands
def test_rerun_into_a_folder_that_holds_a_run_is_refused_until_resume_or_overwrite(rerun):
    again = rerun.again
    assert again.returncode == 2
    assert str(rerun.run) in again.stderr and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr
    assert rerun.metrics_after_again == rerun.metrics_after_first and rerun.latest_after_again == "step2"  # untouched

    assert rerun.latest_after_resume == "step8"  # --resume trains on (through the saved config here)
    assert "removed the earlier run" in rerun.overwritten.stderr
    assert rerun.tags_after_overwrite == ["step1"] and rerun.latest_after_overwrite == "step1"


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets `rerun` up: 6 commands
def test_pruning_keeps_an_earlier_runs_higher_tags_and_never_the_latest(rerun):
    assert rerun.tags_after_resume == ["step2", "step4", "step6", "step8"]  # the earlier runs kept every tag
    # Back to step 2 and on to 6 keeping 2: only tags this run wrote may go.
    assert rerun.latest_after_prune == "step6"
    assert rerun.tags_after_prune == ["step4", "step6", "step8"]  # step2 (resumed from) pruned; step8 is not this run's
    assert rerun.consolidated.returncode == 0, rerun.consolidated.stderr


@pytest.mark.slow
@pytest.mark.parametrize("target", ["missing", "file", "no_latest"])
def test_a_resume_target_that_is_not_a_checkpoint_fails_before_any_step(zerotrain_main, tmp_path, target):
    run = tmp_path / "run"
    bad = {"missing": tmp_path / "nope", "file": tmp_path / "file.txt", "no_latest": tmp_path / "empty"}[target]
    if target == "file":
        bad.write_text("x")
    elif target == "no_latest":
        bad.mkdir()
    proc = _train(zerotrain_main, run, "--training.max_steps", "2", "--training.resume", bad, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(bad) in proc.stderr and "training.resume" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets `rerun` up: 6 commands
def test_the_saved_config_resumes_from_any_folder_with_relative_paths_made_absolute(rerun):
    # Relative paths used to stay relative in RUN/config.yaml: the printed resume command failed
    # (or wrote a stray run) from any other folder.
    saved = rerun.config_after_first
    assert f"dir: {rerun.cwd / 'runs' / 'rel'}" in saved and f"cache_dir: {rerun.cwd / 'cache'}" in saved, saved
    assert rerun.resumed.returncode == 0  # run from `elsewhere` with only config.yaml's path
    assert rerun.latest_after_resume == "step8" and not (rerun.elsewhere / "runs").exists()


def test_resume_with_no_checkpoint_fails_before_any_rank_starts_naming_the_folder(zerotrain_main, tmp_path):
    # It used to start a new run from step 0 and exit 0. Not slow: it ends before any rank starts.
    run = tmp_path / "run"
    proc = _train(zerotrain_main, run, "--training.max_steps", "2", "--resume", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing to resume" in proc.stderr and str(run / "checkpoints") in proc.stderr, proc.stderr
    assert "training.resume: auto" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists(), "nothing is written"


@pytest.mark.slow
def test_a_foreground_run_refuses_a_folder_with_a_live_run(zerotrain_main, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / "train.pid").write_text(f"{live.pid}\n")
        proc = _train(zerotrain_main, run, "--training.max_steps", "1", check=False)
        assert proc.returncode == 2
        assert str(live.pid) in proc.stderr and "zerotrain stop" in proc.stderr
        assert (run / "train.pid").read_text().strip() == str(live.pid)  # not deleted
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets `rerun` up: 6 commands
def test_resume_with_another_global_batch_or_schedule_says_old_and_new(rerun):
    said = rerun.resumed.stdout + rerun.resumed.stderr  # 2 steps of 4 samples, resumed with 8 to step 8
    assert "global batch (samples per step): 4 → 8" in said
    assert "total steps: 2 → 8" in said


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


# That --detach reports "started" only once the ranks are up (train.started written) is checked by
# tests/train/test_train_job.py::test_detached_run_is_followed_and_stopped_cleanly_after_a_checkpoint,
# on the detached run it follows and stops.


@pytest.mark.slow
def test_detach_of_a_run_that_dies_at_start_shows_its_error_and_fails(zerotrain_main, tmp_path):
    run = tmp_path / "run"
    # Valid config, but the model cannot be built: the run dies after it was detached. The command
    # runs in this process; the detached run it starts is a process of its own, as ever.
    proc = _train(zerotrain_main, run, "--model.config_overrides.num_attention_heads", "3", "--detach", check=False)
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
