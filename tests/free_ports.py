"""Ports for the jobs tests start, chosen so that nothing else takes them before the job binds.

A port the kernel picks (`bind(0)`) comes from the ephemeral range, the same range every outgoing
connection draws from: between the pick and the job's own bind, a Gloo or NCCL connection of a
test on another xdist worker can land on it ("--master_port ... is already in use", seen with 8
workers on a GPU machine). So ports come from below that range, where the kernel never hands out
ports by itself, in a block of its own for each xdist worker.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

_BLOCK = 1000  # ports per xdist worker
# A random start: two test sessions on one machine (a developer's and a CI clone's) rarely meet.
_next = itertools.count(random.randrange(_BLOCK))


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... under xdist
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    blocks = max(1, (_ephemeral_low() - 10_000) // _BLOCK)
    return 10_000 + (index % blocks) * _BLOCK


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `address` now, in this worker's block (see the module)."""
    start = _block_start()
    for _ in range(_BLOCK):
        port = start + next(_next) % _BLOCK
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue  # in use, or still in TIME_WAIT from an earlier job: the next one
            return port
    raise RuntimeError(f"no free port in {start}..{start + _BLOCK - 1} on {address}")
