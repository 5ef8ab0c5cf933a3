"""`zerotrain bench run` on real sshd "nodes" 127.0.0.11-13: concurrency, timeout, crash, signals, bad inputs."""

from __future__ import annotations

import pytest

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from launcher.sshd_nodes import processes_with_env

from conftest import FIXTURES, zerotrain_script
from free_ports import free_port
from zerotrain.bench.run_dir import JobStatus
from zerotrain.bench.run_progress import LogWatcher, last_throughput

JOB = FIXTURES / "scripts" / "bench_job.py"
NODES = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
# After bench run returns, nothing of a job may still run anywhere; node agents need a moment.
TEARDOWN_S = 10
# Three launches at once take ~22 s to finish a trivial job on a 2-core machine (torch imports, pre-flight):
# the timeout leaves the normal job room, and stops the sleeping one.
TIMEOUT_S = 35


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop("ZEROTRAIN_JOB_ID", None)
    return env


def _hostfiles(folder: Path, nodes) -> Path:
    folder.mkdir()
    for index, node in enumerate(nodes, start=1):
        (folder / f"batch-{index:03d}").write_text(f"{node} slots=1\n")
    return folder


def _bench_argv(hostfiles: Path, run: Path, cluster, timeout: float, *job: str) -> list[str]:
    return [zerotrain_script(), "bench", "run", str(hostfiles), "--timeout", str(timeout), "--out", str(run),
            "--grace", "10", "--ssh_args", cluster.ssh_args, "--", str(JOB), *job]


def _wait_until_gone(job_id: str, timeout: float = TEARDOWN_S) -> None:
    deadline = time.monotonic() + timeout
    while processes_with_env("ZEROTRAIN_JOB_ID", job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_env("ZEROTRAIN_JOB_ID", job_id), f"job {job_id} left processes running"


def _pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_three_jobs_run_at_once_and_end_finished_failed_and_timeout(make_ssh_nodes, tmp_path):
    cluster = make_ssh_nodes(NODES)
    hostfiles, run = _hostfiles(tmp_path / "hostfiles", NODES), tmp_path / "run"
    markers, cwd = tmp_path / "markers", tmp_path / "cwd"
    for folder in (markers, cwd):
        folder.mkdir()
    (hostfiles / ".hidden").write_text("not a hostfile, and skipped\n")
    argv = _bench_argv(hostfiles, run, cluster, TIMEOUT_S, str(markers), "--jobs", "3", "--crash", NODES[1],
                       "--sleep", NODES[2])
    started = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=90)
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    statuses = {s.job: s for s in (JobStatus.read(run / name) for name in ("batch-001", "batch-002", "batch-003"))}
    assert {name: s.state for name, s in statuses.items()} == {
        "batch-001": "finished", "batch-002": "failed", "batch-003": "timeout"}, output
    assert [s.nodes for s in statuses.values()] == [[node] for node in NODES]
    assert len({s.master_port for s in statuses.values()}) == 3
    # They ran at once: each rank waited until all three had started.
    for name in ("batch-001", "batch-002"):
        assert "saw 3 of 3 jobs running" in (run / name / "log.txt").read_text(), name
    windows = [(s.started, s.ended) for s in statuses.values()]
    assert max(start for start, _ in windows) < min(end for _, end in windows)
    finished, failed, timed_out = statuses.values()
    assert finished.exit_code == 0 and finished.extra["throughput"] == "13.5 samples/s"
    assert failed.exit_code not in (0, None)
    assert "RuntimeError: bench job on 127.0.0.12 crashed on purpose" in (run / "batch-002" / "log.txt").read_text()
    assert timed_out.exit_code is None and TIMEOUT_S <= timed_out.elapsed_s < TIMEOUT_S + 12, timed_out
    assert took < TIMEOUT_S + 20, took
    sleeper = int((markers / f"{NODES[2]}.start").read_text())
    for status in statuses.values():
        _wait_until_gone(status.extra["job_id"])
    assert not _pid_alive(sleeper)
    assert (run / "batch-003" / "hostfile").read_text() == f"{NODES[2]} slots=1\n"
    record = json.loads((run / "run.json").read_text())
    assert record["jobs"] == ["batch-001", "batch-002", "batch-003"] and record["exit_code"] == 1
    assert record["counts"] == {"finished": 1, "failed": 1, "timeout": 1}
    assert "--force_multi" in record["launch_flags"] and record["timeout_s"] == TIMEOUT_S
    # On a pipe: one line per state change (a failed job's with its cause and log), then the logs and what next.
    assert "batch-003  127.0.0.13  timeout" in done.stdout and "batch-002  127.0.0.12  failed (exit" in done.stdout
    failed_line = next(line for line in done.stdout.splitlines() if "batch-002  127.0.0.12  failed" in line)
    assert failed_line.endswith(f"RuntimeError: bench job on 127.0.0.12 crashed on purpose  "
                                f"(log: {run / 'batch-002' / 'log.txt'})"), failed_line
    assert "JOB/log.txt" not in done.stdout and str(run / "batch-001" / "log.txt") in done.stdout
    assert f"zerotrain bench report {run} --threshold" in done.stdout


@pytest.mark.slow
def test_sigterm_to_bench_run_stops_every_job_and_writes_its_status(make_ssh_nodes, tmp_path):
    cluster = make_ssh_nodes(NODES[:1])
    hostfiles, run, markers = _hostfiles(tmp_path / "hostfiles", NODES[:1]), tmp_path / "run", tmp_path / "m"
    markers.mkdir()
    argv = _bench_argv(hostfiles, run, cluster, 300, str(markers), "--sleep", NODES[0])
    bench = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while not (markers / f"{NODES[0]}.start").exists():
            assert time.monotonic() < deadline and bench.poll() is None, "the job never started"
            time.sleep(0.2)
        bench.send_signal(signal.SIGTERM)
        output, _ = bench.communicate(timeout=40)
        assert bench.returncode == 128 + signal.SIGTERM, output
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    status = JobStatus.read(run / "batch-001")
    assert status.state == "failed" and status.extra["stopped_by"] == "SIGTERM" and status.ended, status
    assert json.loads((run / "run.json").read_text())["interrupted_by"] == "SIGTERM"
    _wait_until_gone(status.extra["job_id"])
    assert not _pid_alive(int((markers / f"{NODES[0]}.start").read_text()))


@pytest.mark.slow
def test_a_failed_jobs_cause_and_real_log_path_show_on_the_console_and_in_the_report(zerotrain_cli, tmp_path):
    # No sshd listens there: the launch's pre-flight fails, then prints its hints. The cause is the error.
    hostfiles = _hostfiles(tmp_path / "hostfiles", ["127.0.0.14"])
    port = free_port("127.0.0.14")
    done = zerotrain_cli("bench", "run", hostfiles, "--timeout", "60", "--out", "run", "--ssh_port", port,
                         "--ssh_args", "-o BatchMode=yes", "--", JOB, tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    log = (zerotrain_cli.cwd / "run" / "batch-001" / "log.txt").read_text()
    assert "(--skip_preflight starts the job without these checks)" in log.splitlines()[-1], log
    failed = next(line for line in done.stdout.splitlines() if "batch-001  127.0.0.14  failed" in line)
    cause = f"127.0.0.14: ssh connection refused; ssh to 127.0.0.14: connection refused on port {port}"
    assert cause in failed and "skip_preflight" not in failed, failed
    assert failed.endswith("(log: run/batch-001/log.txt)"), failed
    assert "logs in run/batch-001/log.txt" in done.stdout and "JOB/log.txt" not in done.stdout, done.stdout
    report = zerotrain_cli("bench", "report", "run", "--threshold", "1", "--csv", "results.csv")
    assert report.returncode == 1, report.stdout + report.stderr
    (row,) = csv.DictReader((zerotrain_cli.cwd / "results.csv").open())
    assert row["verdict"] == "crash" and row["reason"].startswith(f"exit 2: {cause}"), row
    assert row["reason"].removeprefix("exit 2: ") in failed  # the console's cause and the report's are one


@pytest.mark.slow
def test_hostfiles_sharing_a_node_are_refused_naming_the_node(zerotrain_cli, tmp_path):
    hostfiles = tmp_path / "hostfiles"
    hostfiles.mkdir()
    (hostfiles / "a").write_text("127.0.0.11 slots=1\n127.0.0.12 slots=1\n")
    (hostfiles / "b").write_text("127.0.0.12 slots=1\n")
    done = zerotrain_cli("bench", "run", hostfiles, "--timeout", "5", "--out", tmp_path / "run", "--", "x.py")
    assert done.returncode == 2, done.stderr
    assert "node 127.0.0.12 is in both" in done.stderr and str(hostfiles / "a") in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def _bench_in_process(capsys, *argv) -> tuple[int, str]:
    from zerotrain.cli.main import main

    code = main(["bench", "run", *map(str, argv)])
    return code, " ".join(capsys.readouterr().err.split())  # unwrapped, whatever the terminal width


def test_an_empty_hostfile_folder_is_refused(capsys, tmp_path):
    (tmp_path / "hostfiles").mkdir()
    code, err = _bench_in_process(capsys, tmp_path / "hostfiles", "--timeout", "5", "--out", tmp_path / "run",
                                  "--", "x.py")
    assert code == 2 and "holds no hostfiles" in err and "bench split" in err, err


def test_a_file_that_is_not_a_hostfile_is_named_before_anything_starts(capsys, tmp_path):
    hostfiles = tmp_path / "hostfiles"
    hostfiles.mkdir()
    (hostfiles / "batch-001").write_text("127.0.0.11 slots=1\n")
    (hostfiles / "notes.txt").write_text("remember to check node 5\n")
    code, err = _bench_in_process(capsys, hostfiles, "--timeout", "5", "--out", tmp_path / "run", "--", "x.py")
    assert code == 2 and f"{hostfiles / 'notes.txt'} is not a hostfile" in err, err
    assert not (tmp_path / "run").exists()


def test_the_job_must_be_given_after_double_dash_or_as_a_workload(capsys, tmp_path):
    hostfiles = _hostfiles(tmp_path / "hostfiles", NODES[:1])
    code, err = _bench_in_process(capsys, hostfiles, "--timeout", "5", "--out", tmp_path / "run")
    assert code == 2 and "after `--`" in err, err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old.txt").write_text("a previous run\n")
    code, err = _bench_in_process(capsys, hostfiles, "--timeout", "5", "--out", tmp_path / "run", "--", "x.py")
    assert code == 2 and "not an empty folder" in err, err


def test_a_built_in_workload_runs_zerotrain_train_into_the_job_folder(capsys, tmp_path):
    hostfiles = tmp_path / "hostfiles"
    hostfiles.mkdir()
    (hostfiles / "batch-001").write_text("worker-0 slots=1\n")
    run = tmp_path / "run"
    # --dry_run (a launch flag) prints each job's node command instead of running it.
    code, _ = _bench_in_process(capsys, hostfiles, "--timeout", "60", "--out", run, "--dry_run",
                                "--workload", "llama-125m", "--", "--training.max_steps", "50")
    log = (run / "batch-001" / "log.txt").read_text()
    assert code == 0 and JobStatus.read(run / "batch-001").state == "finished", log
    node_job = json.loads(log.split("# stdin: ", 1)[1].splitlines()[0])
    assert node_job["module"] and node_job["target"] == "zerotrain" and not node_job["local_rank_arg"]
    assert node_job["target_args"][0] == "train" and node_job["target_args"][1].endswith("llama-125m.yaml")
    assert node_job["target_args"][2:4] == ["--output.dir", str((run / "batch-001" / "train").resolve())]
    assert node_job["target_args"][-2:] == ["--training.max_steps", "50"]  # overrides after `--` reach train
    code, err = _bench_in_process(capsys, hostfiles, "--timeout", "60", "--out", tmp_path / "run2",
                                  "--workload", "llama-7t")
    assert code == 2 and "llama-125m" in err, err


def test_launch_flags_pass_through_whole_and_one_node_jobs_run_on_their_node():
    from zerotrain.bench.runner import launch_flags
    from zerotrain.cli.main import build_parser

    args = build_parser().parse_args(
        ["bench", "run", "hf", "--timeout", "9", "--out", "r", "--ssh_args", "-F my config", "--env", "A=1",
         "--env", "B=2", "--num_gpus", "1", "--module", "--", "zerotrain", "train", "my.yaml", "--", "x"])
    assert args.job == ["zerotrain", "train", "my.yaml", "--", "x"]
    assert launch_flags(args) == ["--gpus-per-node=1", "--ssh_args=-F my config", "--env=A=1", "--env=B=2", "--module",
                                  "--force_multi"]
    flags_after = build_parser().parse_args(["bench", "run", "hf", "--timeout", "9", "--out", "r", "--",
                                             "--module", "zerotrain", "train"])
    assert flags_after.job == ["--module", "zerotrain", "train"] and launch_flags(flags_after) == ["--force_multi"]


def test_last_throughput_is_read_from_the_new_part_of_a_log(tmp_path):
    assert last_throughput("step 3 | 12,345 tok/s | 1.5 samples/s\n") == "1.5 samples/s"
    assert last_throughput("[node1 0]: epoch 1 SamplesPerSec=51.2, MemAllocated=1GB") == "51.2 samples/s"
    assert last_throughput("Throughput: 812.3 samples/sec\n") == "812.3 samples/s"
    assert last_throughput("{'train_samples_per_second': 7.5, 'epoch': 1.0}") == "7.5 samples/s"
    assert last_throughput("loss 2.1\n") is None
    log = tmp_path / "log.txt"
    log.write_text("Throughput: 10\nThroughput: 2")  # the last line is not complete yet: unit unknown
    watcher = LogWatcher(log)
    assert watcher.poll() and watcher.throughput == "Throughput: 10"
    with log.open("a") as f:
        f.write("0\n")
    assert watcher.poll() and watcher.throughput == "Throughput: 20"
    assert not watcher.poll()
