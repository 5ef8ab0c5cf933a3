"""A one-host Slurm cluster for tests: munged, slurmctld and slurmd, everything under a temp folder.

Debian's slurm-wlm and munge (.ci/run installs them). The config is written here: free loopback
ports, StateSaveLocation and SlurmdSpoolDir in the folder, munge on a socket of its own, no cgroups
(proctrack/linuxproc, task/none). The daemons are stopped by the pids they wrote, never by name.
A service that does not start fails the test with its log, not a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from free_ports import free_port

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


@dataclass
class SlurmCluster:
    folder: Path
    conf: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a user of this cluster (srun, sbatch, scancel find it by SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": "1", **extra}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def wait_for_job(self, job_id: str, timeout: float) -> str:
        """Waits until the job left the queue; returns its final state (from sacct-less scontrol)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.run("scontrol", "show", "job", job_id).stdout
            state = next((part.split("=", 1)[1] for part in shown.split() if part.startswith("JobState=")), "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(1)
        raise AssertionError(f"Slurm job {job_id} still queued after {timeout:g} s")


def _config(folder: Path, host: str) -> str:
    cpus = max(2, os.cpu_count() or 2)
    return "\n".join([
        "ClusterName=zerotrain-test", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={folder}/munge.sock", "CredType=cred/munge",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none", "KillWait=5",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
    ])


def _stop(pid_file: Path) -> None:
    try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):
        pass


def start_cluster(folder: Path) -> SlurmCluster:
    """Starts munged, slurmctld and slurmd; fails (with the reason and logs) if one does not come up."""
    missing = [d for d in DAEMONS if not os.access(d, os.X_OK)] + [c for c in ("srun", "sbatch") if not shutil.which(c)]
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                    "(.ci/run does)")
    if os.geteuid() != 0:
        pytest.fail("the Slurm test cluster runs slurmd as root: run the tests as root (CI does)")
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    started = subprocess.run([DAEMONS[0], f"--socket={folder}/munge.sock", f"--key-file={key}",
                              f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                              f"--seed-file={folder}/munge.seed", "--force"], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"munged did not start: {started.stderr.strip()}")
    host = socket.gethostname()
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, host))
    cluster = SlurmCluster(folder, conf)
    for daemon in DAEMONS[1:]:
        done = subprocess.run([daemon], env=cluster.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"{daemon} did not start: {done.stderr.strip()}\n{_logs(folder)}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "idle" in cluster.run("sinfo", "-h", "-o", "%T").stdout:
            return cluster
        time.sleep(0.5)
    pytest.fail(f"the Slurm node never became idle:\n{cluster.run('sinfo').stdout}\n{_logs(folder)}")


def stop_cluster(cluster: SlurmCluster) -> None:
    for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
        _stop(cluster.folder / name)


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(folder.glob("*.log")))
