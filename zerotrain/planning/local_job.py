"""A function run on N local processes by torch's elastic launcher, in-process: no ssh, no relaunch.

`plan --verify` and `tune` use it. The ranks' output goes to files in a temporary folder so the
command's own output (JSON too) stays clean; a rank's exception reaches the caller as torch's
`ChildFailedError`, whose failures carry each rank's error message.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import uuid
from dataclasses import replace
from typing import Any, Callable


def run_local_job(fn: Callable[..., Any], nprocs: int, *args: Any, name: str = "zerotrain",
                  rank0_to_console: bool = False, master_port: int | None = None) -> dict[int, Any]:
    """Runs `fn(*args)` on `nprocs` ranks (Gloo without GPUs, NCCL with); {rank: return value}.

    `rank0_to_console`: rank 0's output is shown (progress), the other ranks' kept in files.
    `master_port`: the rendezvous port (`--master_port`, as `launch` and `train` take it);
    unset: a free one.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = master_port
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    # One machine: the static rendezvous, as `zerotrain launch` (torchrun) uses, so the ranks'
    # MASTER_PORT is this port and no other is opened.
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, monitor_interval=0.1,
        start_method="spawn", rdzv_configs={"rank": 0},
    )
    # A failed rank is reported by the command, not as the launcher's stack dumps.
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory() as logs:
            if hasattr(config, "logs_specs"):
                redirects = {r: Std.ALL for r in range(1, nprocs)} if rank0_to_console else Std.ALL
                config = replace(config, logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=redirects))
            return elastic_launch(config, fn)(*args)
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def recorded(fn):
    """torch's `record`: a rank's exception reaches the launcher in its error file."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)
