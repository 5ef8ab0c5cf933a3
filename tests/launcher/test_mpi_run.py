"""A real `mpirun` (Open MPI, installed by .ci/run) starts the ranks: `zerotrain launch --launcher openmpi`
and `zerotrain train --launcher openmpi` on this machine, losses equal to the local launcher's.

No skip: without mpirun the test fails and says what to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import zerotrain_script
from free_ports import free_port
from launcher.local_reference_run import JOB, MAX_STEPS, local_run_losses, losses  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow
# Open MPI refuses root unless told; CI (and many containers) run as root.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_plm_rsh_agent": "",
           "OMP_NUM_THREADS": "1"}


def _require_mpirun() -> None:
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: install Open MPI (apt-get install openmpi-bin; .ci/run does)")


def test_mpirun_starts_every_rank_of_a_launched_script(tmp_path):
    _require_mpirun()
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    (tmp_path / "rank.py").write_text(
        "import torch, zerotrain\nimport torch.distributed as dist\nzerotrain.init_distributed('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
        "print(f'MPI_REPORT rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}', flush=True)\n")
    done = subprocess.run([zerotrain_script(), "launch", "--hostfile", "hostfile", "--launcher", "openmpi",
                           "--master_port", str(free_port()), "rank.py"], cwd=tmp_path,
                          env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "mpirun -n 2" in done.stdout + done.stderr
    # Found anywhere in the output: mpirun forwards both ranks' stdout, and two reports arriving at
    # once can share a line (seen in CI: "...sum=3.0MPI_REPORT rank=1 ...").
    assert sorted(re.findall(r"MPI_REPORT rank=\d+ world=\d+ sum=[0-9.]+", done.stdout)) == [
        "MPI_REPORT rank=0 world=2 sum=3.0", "MPI_REPORT rank=1 world=2 sum=3.0"]


def test_zerotrain_train_under_mpirun_matches_the_local_run(tmp_path, local_run_losses):
    _require_mpirun()
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    run = tmp_path / "mpi"
    done = subprocess.run([zerotrain_script(), "train", "--hostfile", "hostfile", "--launcher", "openmpi",
                           "--master_port", str(free_port()), "--output.dir", str(run),
                           "--data.cache_dir", str(tmp_path / "cache"), *MAX_STEPS, *JOB],
                          cwd=tmp_path, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "mpirun -n 2" in done.stdout + done.stderr, done.stderr[-2000:]
    assert losses(run) == local_run_losses and len(local_run_losses) == 4
