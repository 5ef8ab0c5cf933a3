"""`zerotrain bench comm HOSTFILE`: collective bandwidth across all nodes, then for every node pair.

    zerotrain bench comm HOSTFILE [--max-size 1G] [--min-size 1K] [--factor 4] [--warmup 5] [--iters 20]
                         [--no-pairs] [--json FILE] [--timeout S] [--num_gpus N] [--master_port P]
                         [--ssh_args "..."] [--ssh_port P] [--launcher ssh|slurm|...] [--skip_preflight]

1. Every slot of every node: all-reduce, all-gather and reduce-scatter over the sizes, one table
   per collective (size, time, algbw, busbw as nccl-tests define them, see bandwidth.py).
2. Every node pair, one rank per node: all-reduce at the largest size. A link that is slow shows
   as one slow pair; a node that is slow shows in every pair it is in.

Each measurement is one `zerotrain launch` of `zerotrain.bench.comm_worker` (pre-flight checks,
teardown of every node when it fails or times out); the worker's rank 0 prints marked lines that
arrive here through the launcher's merged output.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zerotrain.bench.bandwidth import (
    COLLECTIVES, MARKER, BandwidthRow, PairResult, diagnose_pairs, format_bytes, format_size, format_time_us,
    parse_size, slowest_pair,
)

_MARKED = re.compile(rf"{MARKER} (start|row|done) (\{{.*\}})\s*$")
STOP_GRACE_S = 30.0
"""After SIGTERM, the launcher stops every node within this (its own deadline is 25 s)."""
LAUNCH_FLAGS = ("ssh_args", "ssh_port", "launcher", "launcher_args", "master_addr")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(error)) from error


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `comm` to `zerotrain bench`."""
    p = commands.add_parser(
        "comm", help="collective bandwidth (all-reduce, all-gather, reduce-scatter) across nodes and per node pair",
        description="Measure all-reduce, all-gather and reduce-scatter bandwidth over sizes 1K..1G on every node "
        "of HOSTFILE (bus bandwidth as nccl-tests define it), then the all-reduce bandwidth of every node pair "
        "(one rank per node), to tell a slow link from a slow node. Runs through `zerotrain launch`.")
    add = p.add_argument
    add("hostfile", metavar="HOSTFILE", help="'host slots=N' lines, as zerotrain launch reads")
    add("--max-size", type=_size, default=None, metavar="SIZE",
        help="largest size, e.g. 256M (default: 1G with GPUs; 64M on CPU-only nodes, where Gloo is slow)")
    add("--min-size", type=_size, default=parse_size("1K"), metavar="SIZE", help="smallest size (default: 1K)")
    add("--factor", type=int, default=4, choices=[2, 4], help="size step (default: %(default)s)")
    add("--warmup", type=int, default=5, metavar="N", help="untimed calls per size (default: %(default)s)")
    add("--iters", type=int, default=20, metavar="N", help="timed calls per size (default: %(default)s)")
    add("--no-pairs", action="store_true", help="skip the per-pair measurements")
    add("--json", default=None, metavar="FILE", help="also write every result to FILE as JSON")
    add("--timeout", type=float, default=600.0, metavar="S",
        help="stop a measurement (all nodes, or one pair) after S seconds; it is reported as failed (default: 600)")
    add("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=None, metavar="N",
        help="ranks per node for the all-node run (default: every slot)")
    add("--master_port", type=int, default=29500, metavar="PORT",
        help="rendezvous port; pair k uses PORT+1+k%%64 (default: %(default)s)")
    add("--master_addr", default=None, metavar="ADDR")
    add("--ssh_args", default=None, metavar="ARGS", help='extra options for every ssh call, e.g. "-F my_ssh_config"')
    add("--ssh_port", type=int, default=None, metavar="PORT")
    add("--launcher", default=None, choices=["ssh", "pdsh", "openmpi", "mpich", "impi", "slurm"])
    add("--launcher_args", default=None, metavar="ARGS")
    add("--skip_preflight", action="store_true", help="start without zerotrain launch's node checks")
    p.set_defaults(handler=run_comm)


@dataclass
class WorkerRun:
    """What one launch of the worker gave: its start info, rows, and how it ended."""

    exit_code: int | None = None
    timed_out: bool = False
    start: dict = field(default_factory=dict)
    rows: list[BandwidthRow] = field(default_factory=list)
    output_tail: list[str] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        if self.timed_out:
            return "timed out"
        if self.exit_code != 0:
            return f"exit {self.exit_code}: {failure_line(self.output_tail)}"
        return None


def failure_line(output: list[str]) -> str:
    """The line of a failed launch's output that says what failed: the launcher's "first failure" line,
    else the last line that is not a hint, a rule or the wall time."""
    found = next((line for line in output if "first failure:" in line), None)
    found = found or next((line for line in reversed(output)
                           if line.strip() and not line.strip().startswith(("(", "wall time", "─"))), "")
    return found.strip()


def launch_argv(args: argparse.Namespace, hostfile: Path, worker_args: list[str], port: int,
                num_gpus: int | None = None) -> list[str]:
    """The `zerotrain launch ... --module zerotrain.bench.comm_worker ARGS` command of one measurement."""
    argv = [sys.executable, "-m", "zerotrain", "launch", "--hostfile", str(hostfile), "--master_port", str(port)]
    for flag in LAUNCH_FLAGS:
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    if num_gpus is not None:
        argv += ["--num_gpus", str(num_gpus)]
    if args.skip_preflight:
        argv.append("--skip_preflight")
    return [*argv, "--no_local_rank", "--module", "zerotrain.bench.comm_worker", *worker_args]


def run_worker(argv: list[str], timeout_s: float, on_row=lambda run: None) -> WorkerRun:
    """Runs one launch, collecting the marked lines; stops it (every node) at `timeout_s`."""
    run = WorkerRun()
    lines: queue.Queue = queue.Queue()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1)

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline and not run.timed_out:
                run.timed_out = True
                proc.send_signal(signal.SIGTERM)  # the launcher then stops the job on every node
                deadline = time.monotonic() + STOP_GRACE_S
            elif run.timed_out and time.monotonic() >= deadline:
                proc.kill()
                break
            continue
        if line is None:
            break
        found = _MARKED.search(line)
        if not found:
            run.output_tail = [*run.output_tail[-39:], line.rstrip("\n")]
        elif found.group(1) == "start":
            run.start = json.loads(found.group(2))
        elif found.group(1) == "row":
            run.rows.append(BandwidthRow(**json.loads(found.group(2))))
            on_row(run)
    run.exit_code = proc.wait()
    return run


def _measure_all(args, nodes: dict[str, int], console: Console) -> WorkerRun:
    worker = ["--min-size", str(args.min_size), "--factor", str(args.factor), "--warmup", str(args.warmup),
              "--iters", str(args.iters)] + (["--max-size", str(args.max_size)] if args.max_size else [])
    argv = launch_argv(args, Path(args.hostfile), worker, args.master_port, args.num_gpus)
    with console.status(f"all {len(nodes)} nodes: starting") as status:
        def progress(run: WorkerRun) -> None:
            total = len(run.start.get("sizes", [])) * len(run.start.get("collectives", COLLECTIVES))
            row = run.rows[-1]
            status.update(f"all {len(nodes)} nodes: {row.collective} {format_size(row.size)} ({len(run.rows)}/{total})")

        return run_worker(argv, args.timeout, progress)


def _measure_pairs(args, hosts: list[str], size: int, console: Console) -> list[PairResult]:
    pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1:]]
    results = []
    with tempfile.TemporaryDirectory(prefix="zerotrain-comm-") as folder, console.status("pairs") as status:
        for k, (a, b) in enumerate(pairs):
            status.update(f"pair {k + 1}/{len(pairs)}: {a} - {b}")
            hostfile = Path(folder) / f"pair-{k}"
            hostfile.write_text(f"{a} slots=1\n{b} slots=1\n")
            worker = ["--collectives", "all_reduce", "--min-size", str(size), "--max-size", str(size),
                      "--warmup", str(args.warmup), "--iters", str(args.iters)]
            run = run_worker(launch_argv(args, hostfile, worker, args.master_port + 1 + k % 64), args.timeout)
            row = run.rows[-1] if run.rows and run.error is None else None
            error = run.error or ("no result line" if row is None else None) or (
                f"{row.wrong} wrong elements" if row.wrong else None)
            if error:
                results.append(PairResult((a, b), None, error=error))
            else:
                results.append(PairResult((a, b), row.busbw_gbps, row.time_s, row.size))
    return results


def _check(row: BandwidthRow) -> str:
    if row.wrong:
        return f"[red]{row.wrong} wrong[/]"
    problem = row.bytes_problem()
    return f"[red]{escape(problem)}[/]" if problem else "ok"


def print_collective_tables(console: Console, run: WorkerRun, node_count: int) -> None:
    """One table per collective: size, count, time, algbw, busbw, bytes each rank sends, the checks."""
    info = run.start
    for name in info.get("collectives", COLLECTIVES):
        table = Table(title=f"{name}: {info.get('ranks')} ranks on {node_count} nodes ({info.get('backend')})",
                      title_justify="left")
        for column in ("size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "sent/rank", "check"):
            table.add_column(column, justify="left" if column == "check" else "right")
        for row in (r for r in run.rows if r.collective == name):
            table.add_row(format_size(row.size), f"{row.elements:,}", format_time_us(row.time_s),
                          f"{row.algbw_gbps:.3f}", f"{row.busbw_gbps:.3f}", format_bytes(row.bytes_per_rank),
                          _check(row))
        console.print(table)


def print_pair_table(console: Console, pairs: list[PairResult], diagnosis: dict) -> None:
    """The pairs, the slowest named, and the slow nodes or links it points at."""
    worst = slowest_pair(pairs)
    size = next((p.size for p in pairs if p.size), None)
    table = Table(title=f"node pairs: all_reduce{' ' + format_size(size) if size else ''}, one rank per node",
                  title_justify="left")
    for column in ("pair", "time (us)", "busbw (GB/s)", "note"):
        table.add_column(column, justify="left" if column in ("pair", "note") else "right")
    for p in pairs:
        notes = ["[bold]slowest[/]"] if p is worst and len(pairs) > 1 else []
        notes += [f"[red]{escape(p.error)}[/]"] if p.error else []
        table.add_row(escape(f"{p.nodes[0]} - {p.nodes[1]}"), "-" if p.time_s is None else format_time_us(p.time_s),
                      "-" if p.busbw_gbps is None else f"{p.busbw_gbps:.3f}", "; ".join(notes))
    console.print(table)
    if worst is not None:
        speed = "failed" if worst.busbw_gbps is None else f"{worst.busbw_gbps:.3f} GB/s"
        median = diagnosis["median_gbps"]
        console.print(f"slowest pair: {escape(' - '.join(worst.nodes))} ({speed}"
                      + (f"; median {median:.3f} GB/s)" if median is not None else ")"))
    if diagnosis["slow_nodes"]:
        slow = ", ".join(diagnosis["slow_nodes"])
        console.print(f"[yellow]slow nodes (every pair they are in is slow): {escape(slow)}[/]")
    if diagnosis["slow_links"]:
        links = ", ".join(" - ".join(link) for link in diagnosis["slow_links"])
        console.print(f"[yellow]slow links: {escape(links)}[/]")


def results_json(hostfile: str, hosts: list[str], run: WorkerRun, pairs: list[PairResult]) -> dict:
    """Everything measured, as `--json FILE` holds it."""
    worst = slowest_pair(pairs)
    return {"hostfile": str(hostfile), "nodes": hosts,
            **{k: run.start.get(k) for k in ("ranks", "backend", "device", "capped")},
            "all_nodes": {"rows": [r.as_dict() for r in run.rows], "error": run.error},
            "pairs": [p.as_dict() for p in pairs], "slowest_pair": worst.as_dict() if worst else None,
            "diagnosis": diagnose_pairs(pairs)}


def run_comm(args: argparse.Namespace) -> int:
    """`zerotrain bench comm`: 0 when every measurement ran and checked out, 1 otherwise, 2 on a bad input."""
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.launcher.hostfile import HostfileError, parse_hostfile

    try:
        nodes = parse_hostfile(args.hostfile)
        if args.iters < 1 or args.warmup < 0:
            raise ValueError(f"--iters needs 1 or more and --warmup 0 or more, got {args.iters} and {args.warmup}")
        if args.min_size > (args.max_size or args.min_size):
            raise ValueError(f"--min-size {format_size(args.min_size)} is above "
                             f"--max-size {format_size(args.max_size)}")
    except (HostfileError, OSError, ValueError) as error:
        print_user_error("zerotrain bench comm", error)
        return USAGE_EXIT_CODE
    out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    run = _measure_all(args, nodes, err)
    if run.start.get("capped"):
        err.print(f"[dim]{run.start['backend']} on CPU: sizes capped at {format_size(run.start['sizes'][-1])}; "
                  "pass --max-size to go further[/]")
    if run.rows:
        print_collective_tables(out, run, len(nodes))
    if run.error:
        err.print(f"[red]zerotrain bench comm: the all-node run failed ({escape(run.error)}); its output ends with:[/]")
        err.print(escape("\n".join(run.output_tail[-15:])), highlight=False)
    hosts = list(nodes)
    pairs: list[PairResult] = []
    if not args.no_pairs and len(hosts) > 1:
        # The largest size asked for (rows hold it rounded to the rank count); unknown: the worker caps 1G.
        size = run.start["sizes"][-1] if run.start.get("sizes") else (args.max_size or 1 << 30)
        pairs = _measure_pairs(args, hosts, size, err)
    if pairs:
        print_pair_table(out, pairs, diagnose_pairs(pairs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results_json(args.hostfile, hosts, run, pairs), indent=2) + "\n")
    bad_rows = [r for r in run.rows if r.wrong or r.bytes_problem()]
    return 1 if run.error or bad_rows or any(p.error for p in pairs) else 0
