"""`zerotrain launch` across two real sshd "nodes" on loopback addresses, end to end.

The console script runs from a temp folder, as a user runs it; nodes are reached through
`--ssh_args "-F <ssh_config>"`; Gloo stays on the loopback interface.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .sshd_nodes import processes_with_env

from conftest import FIXTURES, zerotrain_script
from free_ports import free_port

SCRIPTS = FIXTURES / "scripts"
PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time" / "cpu-2026-11-27" / "compute-cpu-5m-2.json"
TRAIN = SCRIPTS / "multinode_train.py"
LOSS = re.compile(r"LOSS step=(\d+) loss=(\S+)")
LAYOUT = re.compile(r"^\[(\S+) (\d+)\]: LAYOUT (.*)$", re.M)
# A job that is stopped must be gone from every node within this many seconds.
TEARDOWN_S = 30
# Jobs that check how a job stops (not what it computes) run one rank per node: the stop crosses
# nodes all the same, with half the ranks to start (each imports torch).
ONE_RANK_PER_NODE = 1


def _env(job_id: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", ZEROTRAIN_JOB_ID=job_id)
    return env


def _launch_argv(cluster, *args: str, port: int, slots: int = 2) -> list[str]:
    hostfile = cluster.hostfile(slots=slots, path=cluster.folder / f"hostfile-{slots}")  # tests may run at once
    return [zerotrain_script(), "launch", "--hostfile", str(hostfile), "--ssh_args",
            cluster.ssh_args, "--master_port", str(port), *args]


def _run(cluster, cwd: Path, *args: str, job_id: str, slots: int = 2, timeout: float = 180
         ) -> subprocess.CompletedProcess:
    return subprocess.run(_launch_argv(cluster, *args, port=free_port(), slots=slots), cwd=cwd, env=_env(job_id),
                          capture_output=True, text=True, timeout=timeout)


def _losses(output: str) -> list[float]:
    return [float(m.group(2)) for m in LOSS.finditer(output)]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_like_one_node_of_four_with_deepspeed_env(ssh_cluster, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    shutil.copy(FIXTURES / "configs" / "deepspeed_env", cwd / ".deepspeed_env")
    tricky = "a b 'c' \"d\" $HOME; echo e \\ f"
    job = f"same-{uuid.uuid4().hex[:8]}"
    done = _run(ssh_cluster, cwd, "--env", f"ZEROTRAIN_TEST_VALUE={tricky}", str(TRAIN), job_id=job)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    layouts = {int(rank): (host, json.loads(body)) for host, rank, body in LAYOUT.findall(done.stdout)}
    assert sorted(layouts) == [0, 1, 2, 3], done.stdout
    first, second = (node.address for node in ssh_cluster.nodes[:2])
    for rank, (host, seen) in layouts.items():
        assert host == (first if rank < 2 else second)  # nodes in hostfile order, ranks contiguous
        assert seen["RANK"] == str(rank) and seen["WORLD_SIZE"] == "4" and seen["LOCAL_SIZE"] == "2"
        assert seen["LOCAL_RANK"] == str(rank % 2) and seen["local_rank_arg"] == rank % 2
        assert seen["CROSS_RANK"] == str(rank // 2) and seen["CROSS_SIZE"] == "2"
        assert seen["MASTER_ADDR"] == first
        assert seen["PROJECT_PATH"] == "/srv/nfs/staging"  # .deepspeed_env: the last value wins
        assert seen["ZEROTRAIN_TEST_VALUE"] == tricky
        assert seen["deepspeed"].endswith("zerotrain/compat/standin/deepspeed/__init__.py")  # each node's own stand-in
    local = subprocess.run([zerotrain_script(), "launch", "--num_gpus", "4", "--master_port", str(free_port()),
                            str(TRAIN)], cwd=cwd, env=_env(f"local-{job}"), capture_output=True, text=True,
                           timeout=180)
    assert local.returncode == 0, local.stderr[-3000:]
    two_nodes, one_node = _losses(done.stdout), _losses(local.stdout)
    assert len(two_nodes) == len(one_node) == 4
    for a, b in zip(two_nodes, one_node):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (two_nodes, one_node)
    assert "job finished on 2 nodes (4 ranks)" in done.stderr


@dataclass
class SleepingJob:
    """A 2 nodes x 1 rank job whose ranks write their pid files in `folder`, then sleep for 120 s."""

    job_id: str
    folder: Path
    launcher: subprocess.Popen


def _start_sleeping_job(cluster, folder: Path) -> SleepingJob:
    job_id = f"{folder.name}-{uuid.uuid4().hex[:8]}"
    argv = _launch_argv(cluster, str(SCRIPTS / "sleep_forever.py"), str(folder), port=free_port(),
                        slots=ONE_RANK_PER_NODE)
    with (folder / "launcher.log").open("w") as log:  # says why, should the job not start
        launcher = subprocess.Popen(argv, cwd=folder, env=_env(job_id), stdout=log, stderr=subprocess.STDOUT)
    return SleepingJob(job_id, folder, launcher)


def _ranks_up(job: SleepingJob) -> bool:
    if job.launcher.poll() is not None:
        log = (job.folder / "launcher.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"job {job.job_id}'s launcher ended with {job.launcher.returncode}:\n{log}")
    return len(_rank_pids(job)) == 2


def _rank_pids(job: SleepingJob) -> list[int]:
    return [int(path.read_text()) for path in job.folder.glob("rank*.pid")]


@pytest.fixture(scope="module")
def sleeping_jobs(ssh_cluster, tmp_path_factory) -> Iterator[dict[str, SleepingJob]]:
    """Two sleeping jobs started together: "killed" for the SIGKILL test (first: they sleep 120 s), "bystander"."""
    jobs = {name: _start_sleeping_job(ssh_cluster, tmp_path_factory.mktemp(name)) for name in ("killed", "bystander")}
    try:
        for job in jobs.values():
            _wait_for(lambda job=job: _ranks_up(job), 90, f"job {job.job_id}'s 2 ranks")
        yield jobs
    finally:
        for job in jobs.values():  # left by a test that failed midway: SIGKILL ends the job on every node
            if job.launcher.poll() is None:
                job.launcher.kill()
            job.launcher.wait()


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_process_of_the_job(sleeping_jobs):
    job = sleeping_jobs["killed"]
    running = processes_with_env("ZEROTRAIN_JOB_ID", job.job_id)
    assert len(running) >= 4 and set(_rank_pids(job)) <= set(running)  # the launcher, ssh, agents, both ranks
    job.launcher.kill()
    job.launcher.wait()
    _wait_for(lambda: not processes_with_env("ZEROTRAIN_JOB_ID", job.job_id), TEARDOWN_S, "every process of the job")


@pytest.mark.slow
def test_failing_rank_on_second_node_stops_the_job_everywhere_and_spares_another_job(
        ssh_cluster, sleeping_jobs, tmp_path):
    cwd, bystander = tmp_path / "cwd", sleeping_jobs["bystander"]
    cwd.mkdir()
    job = f"failing-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    done = _run(ssh_cluster, cwd, str(TRAIN), "--fail-rank", "1", job_id=job, slots=ONE_RANK_PER_NODE)
    took = time.monotonic() - start
    assert done.returncode != 0
    assert "first failure: node 127.0.0.3" in done.stderr and "rank 1" in done.stderr, done.stderr
    assert "RuntimeError: rank 1 failed on purpose" in done.stderr
    assert took < 90, took
    _wait_for(lambda: not processes_with_env("ZEROTRAIN_JOB_ID", job), TEARDOWN_S, "the failed job's processes")
    survivors = processes_with_env("ZEROTRAIN_JOB_ID", bystander.job_id)
    assert len(survivors) >= 4 and set(_rank_pids(bystander)) <= set(survivors), "the other job must survive"
    assert bystander.launcher.poll() is None, "the other job's launcher must survive"
    # SIGTERM to the launcher stops the bystander on both nodes.
    bystander.launcher.send_signal(signal.SIGTERM)
    assert bystander.launcher.wait(TEARDOWN_S) == 128 + signal.SIGTERM
    _wait_for(lambda: not processes_with_env("ZEROTRAIN_JOB_ID", bystander.job_id), 5, "the stopped job's processes")


@pytest.mark.slow
def test_hang_timeout_prints_every_ranks_python_stack(ssh_cluster, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    job = f"hang-{uuid.uuid4().hex[:8]}"
    launcher = subprocess.Popen(
        _launch_argv(ssh_cluster, "--hang_timeout", "4", str(TRAIN), "--hang-rank", "1", "--steps", "3",
                     port=free_port(), slots=ONE_RANK_PER_NODE),
        cwd=cwd, env=_env(job), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 120
        assert launcher.stderr is not None
        while time.monotonic() < deadline:
            line = launcher.stderr.readline()
            if not line:
                break
            lines.append(line)
            if re.match(r'\[127\.0\.0\.3 1\]: .*File ".*multinode_train.py", line \d+ in <module>', line):
                break  # dumps repeat every 4 s of silence: the one taken while rank 1 sleeps at step 1
        text = "".join(lines)
        assert "no output for 4 s" in text, text[-3000:]
        assert re.search(r"\[127\.0\.0\.3 1\]: .*(most recent call first)", text), text[-3000:]
        assert re.search(r'\[127\.0\.0\.3 1\]: .*File ".*multinode_train.py", line \d+ in <module>', text)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(TEARDOWN_S) == 130
        _wait_for(lambda: not processes_with_env("ZEROTRAIN_JOB_ID", job), 5, "the job's processes")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.slow
def test_elastic_job_goes_on_with_the_first_node_when_the_second_nodes_agent_is_killed(ssh_cluster, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    env = {**_env(job), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torch 2.13: restarts hang without it
    argv = _launch_argv(ssh_cluster, "--elastic_training", "--min_elastic_nodes", "1", "--max_elastic_nodes", "2",
                        "--no_local_rank", str(SCRIPTS / "elastic_steps.py"), "16", port=free_port(),
                        slots=ONE_RANK_PER_NODE)
    launcher = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if "world=2" in line and "step=2" in line:
                break
        second_agent = [pid for pid in processes_with_env("ZEROTRAIN_NODE_RANK", "1")
                        if pid in processes_with_env("ZEROTRAIN_JOB_ID", job)
                        and b"--run-agent" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(second_agent) == 1, "".join(lines)
        os.kill(second_agent[0], signal.SIGKILL)
        rest, _ = launcher.communicate(timeout=150)
        output = "".join(lines) + rest
        assert launcher.returncode == 0, output[-4000:]
        assert re.search(r"\[127\.0\.0\.2 \d\]: ELASTIC done restart=[1-9] world=1", output), output[-4000:]
        assert "nodes lost on the way: 127.0.0.3" in " ".join(output.split())
        assert not processes_with_env("ZEROTRAIN_JOB_ID", job)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.slow
def test_zerotrain_train_with_a_hostfile_trains_on_both_nodes(ssh_cluster, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run = tmp_path / "run"
    argv = [zerotrain_script(), "train", "--hostfile", str(ssh_cluster.hostfile(slots=1)), "--nproc_per_node", "1",
            "--ssh_args", ssh_cluster.ssh_args, "--master_port", str(free_port()), "--output.dir", str(run),
            "--data.cache_dir", str(tmp_path / "cache"), "--training.max_steps", "4", "--training.eval_interval", "0",
            "--training.micro_batch_size", "4", "--logging.interval", "1", "--data.synthetic.num_examples", "400",
            "--output.export_hf", "false",  # what is checked is the training on both nodes, not evaluation or export
            # CPU ranks get a step-time prediction from a compute probe: rank 0 makes it for the world the nodes form
            "--logging.compute_probe", str(PROBE)]
    done = subprocess.run(argv, cwd=cwd, env=_env(f"train-{uuid.uuid4().hex[:8]}"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "job finished on 2 nodes (2 ranks)" in done.stderr
    assert "[127.0.0.2 0]: zerotrain train: finished" in done.stdout
    assert (run / "metrics.csv").is_file() and (run / "checkpoints" / "latest").is_file()
    assert (run / "predicted_step.json").is_file(), done.stdout[-4000:] + done.stderr[-4000:]
    prediction = json.loads((run / "predicted_step.json").read_text())
    assert prediction["world_size"] == 2 and prediction["step_s"] > 0
    assert "step time: measured" in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
def test_a_preflight_failure_stops_the_launch_before_any_rank_starts(ssh_cluster, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    hostfile = tmp_path / "hostfile"
    # 127.0.0.9 runs no sshd: refused. Loopback only, as every test address here.
    hostfile.write_text(f"{ssh_cluster.nodes[0].address} slots=2\n127.0.0.9 slots=2\n")
    # A closed port for it, whatever else this machine runs on port 22.
    config = tmp_path / "ssh_config"
    config.write_text(f"Host 127.0.0.9\n  Port {free_port()}\nMatch all\n  Include {ssh_cluster.ssh_config}\n")
    job = f"preflight-{uuid.uuid4().hex[:8]}"
    argv = [zerotrain_script(), "launch", "--hostfile", str(hostfile), "--ssh_args", f"-F {config}",
            str(SCRIPTS / "sleep_forever.py"), str(tmp_path)]
    done = subprocess.run(argv, cwd=cwd, env=_env(job), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pre-flight failed, nothing was started" in done.stderr
    assert re.search(r"127\.0\.0\.9\s+refused", done.stderr), done.stderr
    assert not list(tmp_path.glob("rank*.pid")) and not processes_with_env("ZEROTRAIN_JOB_ID", job)


@pytest.mark.slow
def test_a_stopped_rank_on_another_node_ends_the_job_naming_it_with_every_stack(ssh_cluster, tmp_path):
    # Rank 1 (the second node) freezes with SIGSTOP inside its third forward; rank 0 waits in the
    # gradient reduction. training.hang_timeout turns the wait into an error that names rank 1.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    job = f"hang-{uuid.uuid4().hex[:8]}"
    argv = [zerotrain_script(), "train", "--hostfile", str(ssh_cluster.hostfile(slots=1)), "--nproc_per_node", "1",
            "--ssh_args", ssh_cluster.ssh_args, "--master_port", str(free_port()), "--output.dir", str(tmp_path / "run"),
            "--data.cache_dir", str(tmp_path / "cache"), "--training.max_steps", "8", "--training.eval_interval", "0",
            "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400", "--training.hang_timeout", "6"]
    env = {**_env(job), "ZEROTRAIN_FAULT": "forward:rank1:3:stop"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "hang timeout: 6 s" in out  # said at the start
    assert re.search(r"no progress for 6 s .*rank\(s\) 1 ", out), out[-3000:]
    assert "--- rank 0 stack ---" in out and "in _train_step" in out
    # The stopped rank is continued after its SIGTERM: its node ends the job within the agent's grace,
    # rather than waiting it out and killing the agent.
    assert "node agent was killed" not in out, out[-3000:]
    assert not processes_with_env("ZEROTRAIN_JOB_ID", job), "every process of the job is gone"
