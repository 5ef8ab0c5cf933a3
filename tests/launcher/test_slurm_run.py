"""Real Slurm starts the ranks: `sbatch` of `zerotrain train --launcher slurm` (users' most common
form) on a one-host cluster the test starts (tests/launcher/slurm_cluster.py), losses equal to the
local launcher's; `scancel` stops every rank within 30 s and leaves nothing running.

No skip: if Slurm is missing or a daemon does not start, the test fails and says why.
"""

from __future__ import annotations

import time
import uuid

import pytest

from conftest import zerotrain_script
from free_ports import free_port
from launcher.local_reference_run import JOB, MAX_STEPS, local_run_losses, losses  # noqa: F401 - a fixture
from launcher.slurm_cluster import start_cluster, stop_cluster
from launcher.sshd_nodes import processes_with_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    stop_cluster(cluster)


def _sbatch(slurm, tmp_path, mark: str, train_args: list[str]) -> str:
    script = tmp_path / "job.sh"
    command = " ".join([zerotrain_script(), "train", "--launcher", "slurm", "--nproc_per_node", "2",
                        "--master_port", str(free_port()), *train_args])
    script.write_text(f"#!/bin/bash\n#SBATCH -N 1\n#SBATCH --ntasks-per-node=1\n#SBATCH -o {tmp_path}/slurm-%j.out\n"
                      f"cd {tmp_path}\nexport OMP_NUM_THREADS=1 ZT_TEST_MARK={mark}\n{command}\n")
    done = slurm.run("sbatch", "--parsable", str(script))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_zerotrain_train_in_sbatch_runs_on_the_allocation_and_matches_the_local_run(
        slurm, tmp_path, local_run_losses):
    args = ["--output.dir", str(tmp_path / "slurm-run"), "--data.cache_dir", str(tmp_path / "cache"),
            *MAX_STEPS, *JOB]
    job = _sbatch(slurm, tmp_path, uuid.uuid4().hex, args)
    state = slurm.wait_for_job(job, timeout=180)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", out[-3000:]
    assert "job finished on 1 nodes (2 ranks)" in out, out[-3000:]
    assert losses(tmp_path / "slurm-run") == local_run_losses


def test_scancel_stops_every_rank_within_30_seconds(slurm, tmp_path):
    mark = uuid.uuid4().hex
    args = ["--output.dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"),
            "--training.max_steps", "100000", *JOB]
    job = _sbatch(slurm, tmp_path, mark, args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.csv").exists():
        time.sleep(0.5)  # training has started: every rank is up
    assert (tmp_path / "run" / "metrics.csv").exists(), (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    assert len(processes_with_env("ZT_TEST_MARK", mark)) >= 3  # the launcher, the node agent, the ranks
    cancelled = time.monotonic()
    assert slurm.run("scancel", job).returncode == 0
    while processes_with_env("ZT_TEST_MARK", mark) and time.monotonic() - cancelled < 30:
        time.sleep(0.5)
    assert not processes_with_env("ZT_TEST_MARK", mark), "processes of the job still run 30 s after scancel"
