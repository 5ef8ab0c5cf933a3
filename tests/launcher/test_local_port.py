"""The rendezvous port of a job on one machine: with none given, jobs started together never collide
(the launcher binds the port as it picks it); a given --master_port is used exactly, never moved."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import user_env, zerotrain_script
from free_ports import free_port

pytestmark = pytest.mark.slow  # every test here starts jobs

DEFAULT_PORT = 29500  # DeepSpeed's and torchrun's default, which jobs with no port used to race for
# Each rank says which port it was given, then stays a moment so that jobs started together overlap.
SCRIPT = """
import os, sys, time
print(f"rank {os.environ['RANK']} port {os.environ['MASTER_PORT']}", flush=True)
time.sleep(float(sys.argv[-1]))  # after the --local_rank=K the launcher adds
"""
PORT_LINE = re.compile(r"rank 0 port (\d+)")


def _env() -> dict[str, str]:
    env = user_env(CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOGLEVEL"):
        env.pop(name, None)
    return {k: v for k, v in env.items() if not k.startswith("PET_")}


def _start(tmp_path: Path, *launch_args: str, hold_s: float = 0.0) -> subprocess.Popen:
    """`zerotrain launch --num_gpus 1 [ARGS] rank.py HOLD_S`, as a user runs it, output merged."""
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([zerotrain_script(), "launch", "--num_gpus", "1", *launch_args, str(script), str(hold_s)],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(job: subprocess.Popen) -> tuple[int, str]:
    out, _ = job.communicate(timeout=240)
    return job.returncode, out


def _listening(port: int) -> socket.socket | None:
    """A socket listening on `port` on every interface, or None when something else holds it already."""
    holder = socket.socket()
    try:
        holder.bind(("", port))
        holder.listen()
    except OSError:
        holder.close()
        return None
    return holder


def test_jobs_started_together_without_a_port_each_get_their_own(tmp_path):
    # Before, each job checked that 29500 was free, then bound it a second or so later: started
    # together, all of them saw it free and all but one died with EADDRINUSE.
    jobs = [_start(tmp_path, hold_s=3.0) for _ in range(3)]
    results = [_finish(job) for job in jobs]
    for code, out in results:
        assert code == 0, out[-3000:]
    ports = [int(PORT_LINE.search(out).group(1)) for _, out in results]
    assert len(set(ports)) == len(ports), ports


def test_a_busy_default_port_is_left_alone_and_a_given_port_is_used_exactly(tmp_path):
    holder = _listening(DEFAULT_PORT)  # None: someone else holds 29500 already, busy either way
    try:
        code, out = _finish(_start(tmp_path))
    finally:
        if holder is not None:
            holder.close()
    assert code == 0, out[-3000:]
    assert int(PORT_LINE.search(out).group(1)) != DEFAULT_PORT

    given = free_port()
    code, out = _finish(_start(tmp_path, "--master_port", str(given)))
    assert code == 0, out[-3000:]
    assert f"rank 0 port {given}" in out and f"127.0.0.1:{given}" in out

    busy = free_port()
    holder = _listening(busy)
    assert holder is not None
    try:
        code, out = _finish(_start(tmp_path, "--master_port", str(busy)))
    finally:
        holder.close()
    assert code == 2, out[-3000:]  # a user error, before anything starts: never moved to another port
    assert f"--master_port {busy} is already in use" in out and "rank 0 port" not in out
