"""Ending one job's processes on a node (zerotrain/launcher/job_processes.py), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from zerotrain.launcher.job_processes import job_processes, kill_job_processes
from zerotrain.launcher.node_job import JOB_ID_ENV, NODE_RANK_ENV


def test_a_stopped_process_of_the_job_ends_on_sigterm_not_after_the_grace():
    # A rank frozen by SIGSTOP keeps its SIGTERM pending until continued: without SIGCONT it would
    # wait out the grace and die of SIGKILL.
    job = f"stopped-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, JOB_ID_ENV: job, NODE_RANK_ENV: "0"})
    try:
        os.kill(process.pid, signal.SIGSTOP)
        assert kill_job_processes(job, 0, grace_s=3.0) == [process.pid]
        assert process.wait(10) == -signal.SIGTERM
        assert job_processes(job, 0) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
