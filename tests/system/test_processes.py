"""process_alive: the one answer to "does this pid still run?", for pid files (run_control) and for
temporary folders named by their writer's pid (consolidate). An exited, unreaped child (a zombie)
still answers kill(pid, 0), and must count as dead."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def zombie() -> Iterator[int]:
    """The pid of a child that has exited and that nobody has reaped yet."""
    if not hasattr(os, "waitid") or not os.path.exists("/proc/self/stat"):
        pytest.skip("waits without reaping (waitid) and reads /proc: Linux")
    child = subprocess.Popen([sys.executable, "-c", ""])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # wait for the exit, leave it unreaped
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        yield child.pid
    finally:
        child.wait()


def test_a_zombie_is_dead_a_running_process_alive_and_a_reaped_one_gone(zombie):
    from zerotrain.system.processes import process_alive

    assert process_alive(os.getpid())
    assert not process_alive(zombie)
    reaped = subprocess.Popen([sys.executable, "-c", ""])
    reaped.wait()
    assert not process_alive(reaped.pid)


def test_pid_zero_or_negative_names_no_process():
    from zerotrain.system.processes import process_alive

    # kill(0, 0) asks about this process group and succeeds: a pid file holding 0 is not a run.
    assert not process_alive(0) and not process_alive(-1)


def test_consolidate_clears_the_staging_folder_of_a_zombie_writer(tmp_path, zombie):
    # A consolidate killed midway leaves `.NAME.tmp-HOST-PID`; its writer exited but is unreaped.
    from zerotrain.checkpoint.consolidate import WEIGHTS_NAME, staged_output

    out = tmp_path / "out"
    leftover = tmp_path / f".out.tmp-{socket.gethostname()}-{zombie}"
    leftover.mkdir()
    (leftover / WEIGHTS_NAME).write_bytes(b"half")
    with staged_output(out, WEIGHTS_NAME) as stage:
        (stage / WEIGHTS_NAME).write_bytes(b"whole")
    assert not leftover.exists()
    assert (out / WEIGHTS_NAME).read_bytes() == b"whole"


def test_a_pid_file_of_a_zombie_is_no_running_run(tmp_path, zombie):
    from zerotrain.train.run_control import PID_NAME, running_pid

    (tmp_path / PID_NAME).write_text(f"{zombie}\n")
    assert running_pid(tmp_path) is None
    (tmp_path / PID_NAME).write_text(f"{os.getpid()}\n")
    assert running_pid(tmp_path) == os.getpid()
