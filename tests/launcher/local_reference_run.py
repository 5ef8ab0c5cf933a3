"""The run that `zerotrain train` under Slurm and under mpirun must reproduce: the same 2-rank job
started by zerotrain's own local launcher.

Both modules compare with the same job, so it runs once per test session: the first xdist worker
that asks runs it (under a file lock) and leaves its losses for the other. Its losses are read
from metrics.csv, as the compared runs' are.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import zerotrain_script
from free_ports import free_port

# The job both launchers run, on 2 ranks, a loss logged each step; MAX_STEPS long for the comparison.
JOB = ["--training.eval_interval", "0", "--logging.interval", "1", "--data.synthetic.num_examples", "400",
       "--training.micro_batch_size", "4", "--output.export_hf", "false"]
MAX_STEPS = ["--training.max_steps", "4"]


def losses(run: Path) -> list[tuple[str, str]]:
    """(step, loss) of each logged step of the run in folder `run`, as metrics.csv wrote them."""
    with open(run / "metrics.csv", newline="") as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


def _run_locally(folder: Path) -> list[tuple[str, str]]:
    run = folder / "local-run"
    done = subprocess.run([zerotrain_script(), "train", "--output.dir", str(run), "--master_port", str(free_port()),
                           "--data.cache_dir", str(folder / "cache"), *MAX_STEPS, *JOB], cwd=folder,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return losses(run)


@pytest.fixture(scope="session")
def local_run_losses(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """(step, loss) of JOB for MAX_STEPS run by `zerotrain train` on this machine's local launcher (2 ranks)."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base folder sits in one folder of this session; alone, it is its own.
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    saved = shared / "local-reference-losses.json"
    with FileLock(str(shared / "local-reference-losses.lock")):
        if not saved.is_file():
            folder = shared / "local-reference"
            folder.mkdir(exist_ok=True)
            saved.write_text(json.dumps(_run_locally(folder)))
    return [tuple(row) for row in json.loads(saved.read_text())]
