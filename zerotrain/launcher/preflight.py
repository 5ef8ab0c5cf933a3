"""Pre-flight checks: before a multi-node job starts, ask every node whether it can run its share.

One ssh round trip per node, all nodes at once: the launcher sends
``preflight_probe.py`` to ``PYTHON -`` (the launching node's interpreter path,
which must exist on every node), and the probe answers with what it found. The
same round trip checks the rendezvous port: node 0 listens on it while every
other node connects to MASTER_ADDR:PORT.

The answers are judged here into one table: a row per node, a column per check,
each cell ok, warn or fail with the fix. The job starts only when nothing fails.

Thresholds:

- open files (``ulimit -n``): the node agent raises the soft limit to the hard
  limit, so the hard limit is judged. Each rank keeps sockets to its peers (Gloo
  opens a pair per peer per process group, NCCL a few more for bootstrap and its
  proxy) on top of the few hundred files torch, CUDA and data loading hold open;
  ``min_open_files`` = max(1024, 64 * world_size) leaves room for several process
  groups. Below it fails; below 65536 (the usual cluster setting) it warns.
- locked memory (``ulimit -l``): NCCL over InfiniBand registers buffers with the
  network card, which needs memlock unlimited; on GPU nodes anything else warns.
  Not raised by the job, so the soft limit is judged.
"""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from zerotrain.launcher.node_plan import Node
from zerotrain.launcher.preflight_checks import (  # noqa: F401 - COLUMNS, Check, ...: the checks' API, used here too
    COLUMNS, PROBE_MARKER, SKIP, Check, NodeReport, PreflightReport, PreflightRequest, judge_preflight, min_open_files,
    parse_probe_output,
)
from zerotrain.launcher.ssh import run_on_hosts


def port_window_s(timeout_s: float) -> float:
    """How long node 0 listens, and the others retry: half the time allowed, so that ssh
    start-up and a slow node fit in the other half and the probe answers before it is cut off."""
    return max(1.0, timeout_s / 2)


def probe_params(request: PreflightRequest, node: Node, window_s: float, token: str) -> dict[str, Any]:
    """The probe's parameters for `node` (see preflight_probe.py)."""
    return {
        "cwd": request.cwd,
        "target": request.target,
        "target_kind": request.target_kind,
        "role": "listen" if node.node_rank == 0 else "connect",
        "master_addr": request.master_addr,
        "master_port": request.master_port,
        "peers": len(request.nodes) - 1,
        "window_s": window_s,
        "token": token,
    }


def probe_source(params: Mapping[str, Any]) -> str:
    """The Python program sent to a node: the probe with its parameters as its first line."""
    probe = (Path(__file__).with_name("preflight_probe.py")).read_text(encoding="utf-8")
    # repr() of a str is a valid Python literal, so nothing in the parameters needs escaping by hand.
    return f"PARAMS_JSON = {json.dumps(dict(params))!r}\n{probe}"


def probe_command(python: str) -> str:
    """The remote shell command: the interpreter reads the probe from stdin."""
    return f"exec {shlex.quote(python)} - "


def run_preflight(request: PreflightRequest, timeout_s: float = 30) -> PreflightReport:
    """Probes every node at once over ssh and judges the answers; waits at most about `timeout_s`.

    Node 0 gets a "listen" probe and the others a "connect" one, so they go out as two
    concurrent batches (one stdin text per batch).
    """
    window_s = port_window_s(timeout_s)
    token = secrets.token_hex(8)
    command = probe_command(request.python)
    groups = [[n for n in request.nodes if n.node_rank == 0], [n for n in request.nodes if n.node_rank != 0]]
    results: dict[str, subprocess.CompletedProcess] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(run_on_hosts, [node.host for node in group], command, request.ssh,
                        stdin_text=probe_source(probe_params(request, group[0], window_s, token)), timeout_s=timeout_s)
            for group in groups
            if group
        ]
        for future in futures:
            results.update(future.result())
    return judge_preflight(request, results)


_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render_preflight(report: PreflightReport) -> Table:
    """The report as a table: one row per node, one column per check; failures red, warnings yellow."""
    table = Table(title="zerotrain launch: pre-flight checks", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True)
    # Folded, never cut short with "...": a host name or version must be read in full, even on a narrow terminal.
    table.add_column("node", overflow="fold")
    for heading in COLUMNS.values():
        table.add_column(heading, overflow="fold")
    for row in report.nodes:
        cells = [Text(row.node.host)]
        for key in COLUMNS:
            check = row.checks.get(key, SKIP)
            cells.append(Text(check.cell, style=_STYLES.get(check.status, "")))
        table.add_row(*cells)
    return table
