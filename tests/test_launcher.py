"""`zerotrain launch` end to end: real launcher and worker processes on this machine (CPU, Gloo).

Each test runs `python -m zerotrain launch ...` in a subprocess, as a user would,
with a fixture script from tests/fixtures/scripts/ that reports what it was given.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from free_ports import free_port
from zerotrain.launcher.failures import order_failures

SCRIPTS = Path(__file__).parent / "fixtures" / "scripts"
REPORT = re.compile(
    r"RANK_REPORT rank=(\d+) world=(\d+) local_rank_env=(\d+) local_rank_arg=(\S+) "
    r"sum=(\d+) tag=(\S*) ran_as=(module|script) omp=(\d+|None)"
)
# A launch that is not done by then is hung; fail instead of blocking the suite.
LAUNCH_TIMEOUT_S = 60


def _clean_env() -> dict[str, str]:
    """The test runner's environment minus what would change the launcher's behaviour."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    for name in ("OMP_NUM_THREADS", "LOGLEVEL", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def launch(
    *args: str, cwd: Path | None = None, default_port: bool = False
) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `zerotrain launch ARGS`; returns the finished process (stdout+stderr merged) and seconds taken.

    A fresh free --master_port is passed unless `default_port`, so tests do not
    race each other (or anyone else on the machine) for 29500.
    """
    port_args = [] if default_port else ["--master_port", str(free_port())]
    cmd = [sys.executable, "-m", "zerotrain", "launch", *port_args, *args]
    start = time.monotonic()
    done = subprocess.run(
        cmd,
        cwd=cwd,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    return done, time.monotonic() - start


def reports(output: str) -> dict[int, tuple[str, ...]]:
    """{rank: (world, local_rank_env, local_rank_arg, sum, tag, ran_as, omp)} from report_rank.py's lines."""
    return {int(m.group(1)): m.groups()[1:] for m in REPORT.finditer(output)}


def test_two_ranks_see_their_rank_and_get_local_rank_argument():
    done, _ = launch("--num_gpus", "2", str(SCRIPTS / "report_rank.py"), "--tag", "hello")
    assert done.returncode == 0, done.stdout
    got = reports(done.stdout)
    assert sorted(got) == [0, 1], done.stdout
    omp = str(max(1, (os.cpu_count() or 1) // 2))
    for rank, (world, local_env, local_arg, total, tag, ran_as, omp_seen) in got.items():
        assert world == "2"
        assert local_env == str(rank) and local_arg == str(rank)
        assert total == "3", "the Gloo all_reduce of rank+1 over 2 ranks is 3"
        assert (tag, ran_as, omp_seen) == ("hello", "script", omp)
    assert "OMP_NUM_THREADS" not in done.stdout, "torchrun's own OMP warning should not appear"


@pytest.mark.slow
def test_module_flag_runs_a_module_and_no_local_rank_omits_the_argument():
    # One launch for both flags: the bootstrap handles the run mode and the --local_rank argument apart.
    done, _ = launch("--nproc_per_node", "2", "--no_local_rank", "--module", "report_rank", "--tag", "mod", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout
    got = reports(done.stdout)
    assert sorted(got) == [0, 1], done.stdout
    assert all(fields[5] == "module" and fields[4] == "mod" for fields in got.values()), done.stdout
    assert all(fields[2] == "None" for fields in got.values()), done.stdout
    assert [fields[1] for _, fields in sorted(got.items())] == ["0", "1"], "LOCAL_RANK is still set"


@pytest.mark.slow
def test_module_zerotrain_train_runs_as_written_without_local_rank(tmp_path):
    # zerotrain's own commands read LOCAL_RANK; --local_rank=K used to stop them at argument parsing.
    done, _ = launch("--gpus-per-node", "1", "--module", "zerotrain", "train", "--output.dir", str(tmp_path / "run"),
                     "--training.max_steps", "1", "--training.eval_interval", "0", "--data.synthetic.num_examples",
                     "200", "--output.export_hf", "false", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
def test_no_python_runs_a_program_with_local_rank():
    done, _ = launch("--num_gpus", "2", "--no_python", str(SCRIPTS / "print_rank.sh"), "x")
    assert done.returncode == 0, done.stdout
    lines = sorted(re.findall(r"SHELL_REPORT .*", done.stdout))
    assert lines == [
        "SHELL_REPORT rank=0 world=2 args=--local_rank=0 x",
        "SHELL_REPORT rank=1 world=2 args=--local_rank=1 x",
    ], done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("rank0_waits_in", ["collective", "sleep"])
def test_failing_rank_stops_the_job_with_its_traceback(rank0_waits_in):
    done, seconds = launch("--num_gpus", "2", str(SCRIPTS / "fail_on_rank1.py"), "--rank0", rank0_waits_in)
    out = done.stdout
    assert seconds < 30, f"job took {seconds:.1f}s to stop after rank 1 failed"
    assert done.returncode == 1, out
    assert f"rank 0 waiting ({rank0_waits_in})" in out, "rank 0 must have been waiting when rank 1 failed"
    assert "rank 0 was not stopped" not in out
    assert "Traceback (most recent call last)" in out
    assert "RuntimeError: rank 1 failed on purpose" in out
    # The summary names the rank that raised, not the peer whose collective broke after it.
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) exited with code 1", out), out
    assert "bootstrap.py" not in out, "the traceback should start at the user's script"


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "zerotrain", "launch", "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [str(SCRIPTS / "sleep_forever.py"), str(tmp_path)]
    # Own process group, so the SIGINT below reaches launcher and workers alike, as Ctrl-C in a terminal does.
    proc = subprocess.Popen(
        cmd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2, "the two ranks did not start"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    assert "interrupted" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_missing_script_is_an_error_before_anything_starts(tmp_path):
    done, _ = launch("--num_gpus", "2", str(tmp_path / "no_such_script.py"))
    assert done.returncode == 2
    assert "script not found" in done.stdout
    assert "processes" not in done.stdout, "nothing should have been started"


def test_order_failures_puts_the_rank_that_raised_first():
    def failure(exitcode: int, timestamp: int = 100) -> SimpleNamespace:
        return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)

    # Rank 0 raised later (its collective broke), rank 2 was stopped by the agent.
    failures = {0: failure(1), 1: failure(1), 2: failure(-signal.SIGTERM)}
    assert [rank for rank, _ in order_failures(failures, {0: 2_000, 1: 1_000})] == [1, 0, 2]
    # A native crash (no noted time) goes before Python errors of the same second.
    failures = {0: failure(1), 1: failure(-signal.SIGSEGV)}
    assert [rank for rank, _ in order_failures(failures, {0: 100 * 10**9 + 5})] == [1, 0]
