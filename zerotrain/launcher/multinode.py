"""`zerotrain launch` across the nodes of a hostfile (or a Slurm allocation): plan, check, run, stop.

    hostfile + --include/--exclude/--num_nodes/--num_gpus  ->  node table (node_plan)
    -> pre-flight on every node (ssh)  ->  one node agent per node (ssh, srun, or this machine)
    -> every rank's output merged here  ->  on the first failure, Ctrl-C or SIGTERM, every node
       is told to stop (its control channel closes)  ->  summary: first failure, traceback, wall time

MPI launchers start every rank themselves (mpirun), so they bypass the node agents.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import queue
import shlex
import signal
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zerotrain.launcher.job_output import JobOutput
from zerotrain.launcher.job_summary import summarize
from zerotrain.launcher.local import DEFAULT_MASTER_PORT, LaunchError, LocalLaunch, check_target, launch_local
from zerotrain.launcher.node_job import JOB_ID_ENV, NODE_RANK_ENV, NodeJob
from zerotrain.launcher.node_plan import Node, plan_nodes, world_size
from zerotrain.launcher.node_session import NodeEvent, NodeSession
from zerotrain.launcher.ssh import SshOptions, resolved_address, ssh_argv

LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "impi", "slurm")
# Every process of a stopped job must be gone within 30 s; the node agents use 10 s of it.
STOP_DEADLINE_S = 25.0
# Restarts an elastic agent allows: enough to re-form the job a few times as nodes leave.
ELASTIC_MAX_RESTARTS = 3


@dataclass(frozen=True)
class ClusterLaunch:
    """A parsed `zerotrain launch` request, with DeepSpeed's launcher flags."""

    target: str
    target_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    local_rank_arg: bool = True
    hostfile: str | None = None
    hostfile_given: bool = False
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "ssh"
    launcher_args: str = ""
    ssh: SshOptions = field(default_factory=SshOptions)
    node_rank: int = -1
    no_ssh: bool = False
    force_multi: bool = False
    env_flags: tuple[str, ...] = ()
    elastic: bool = False
    min_nodes: int = -1
    max_nodes: int = -1
    bind_cores: bool = False
    save_pid: bool = False
    each_rank_log: str | None = None
    hang_timeout: float | None = None
    dry_run: bool = False
    skip_preflight: bool = False


def resolve_selection(request: ClusterLaunch) -> dict[str, list[int]] | None:
    """host -> slots this job runs on; None when there is no hostfile: run on this machine alone."""
    from zerotrain.launcher import hostfile

    if request.launcher == "slurm":
        from zerotrain.launcher.slurm import slurm_hosts

        slots = request.num_gpus if request.num_gpus and request.num_gpus > 0 else 1
        hosts = {host: slots for host in slurm_hosts(os.environ)}
        source = "SLURM_JOB_NODELIST"
    else:
        path = request.hostfile or hostfile.DEFAULT_HOSTFILE
        if not os.path.isfile(path) and not request.hostfile_given:
            return None  # DeepSpeed's rule: no hostfile at the default path means this machine only
        hosts = hostfile.parse_hostfile(path)
        source = path
    if (request.include or request.exclude) and (request.num_nodes > 0 or (request.num_gpus or 0) > 0):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude (as with DeepSpeed): "
                          "name the hosts and slots in --include, or drop it and use --num_nodes/--num_gpus")
    selection = hostfile.select_slots(hosts, request.include, request.exclude, source=source)
    return hostfile.limit_selection(selection, request.num_nodes, request.num_gpus or -1)


def _job_environment(request: ClusterLaunch, console: Console) -> dict[str, str]:
    from zerotrain.launcher.job_environment import job_environment

    env, warnings = job_environment(os.environ, cwd=os.getcwd(), home=os.path.expanduser("~"),
                                    env_flags=request.env_flags)
    for warning in warnings:
        console.print(f"[yellow]zerotrain launch: {escape(warning)}[/]")
    return env


def node_jobs(request: ClusterLaunch, nodes: Sequence[Node], master_addr: str, master_port: int,
              env: dict[str, str], job_id: str) -> list[NodeJob]:
    """One NodeJob per node: the same job, each with its node rank and slots."""
    max_nodes = request.max_nodes if request.elastic and request.max_nodes > 0 else len(nodes)
    return [
        NodeJob(
            job_id=job_id, host=node.host, node_rank=node.node_rank, nnodes=max_nodes, nproc=node.nproc,
            master_addr=master_addr, master_port=master_port, cwd=os.getcwd(), target=request.target,
            target_args=tuple(request.target_args), env=env, slots=node.slots, module=request.module,
            no_python=request.no_python, local_rank_arg=request.local_rank_arg, elastic=request.elastic,
            min_nodes=request.min_nodes if request.min_nodes > 0 else None,
            max_restarts=ELASTIC_MAX_RESTARTS if request.elastic else 0, bind_cores=request.bind_cores,
        )
        for node in nodes
    ]


def agent_command(job: NodeJob) -> str:
    """The shell command ssh runs on a node: the launching node's Python, tagged with the job id.

    Only the Python path needs quoting: the job itself follows on stdin as JSON.
    """
    return (f"exec env {JOB_ID_ENV}={shlex.quote(job.job_id)} {NODE_RANK_ENV}={job.node_rank} "
            f"{shlex.quote(sys.executable)} -u -m zerotrain.launcher.node_agent")


def _print_plan(nodes: Sequence[Node], master: str, console: Console) -> None:
    table = Table(title=f"zerotrain launch: {len(nodes)} nodes, {world_size(nodes)} ranks, master {master}")
    for column in ("node rank", "host", "slots", "ranks"):
        table.add_column(column)
    for node in nodes:
        table.add_row(str(node.node_rank), escape(node.host), ",".join(map(str, node.slots)),
                      f"{node.ranks.start}-{node.ranks.stop - 1}")
    console.print(table)


def launch(request: ClusterLaunch, console: Console | None = None) -> int:
    """Runs `request`: on this machine alone, or on every node of its hostfile; returns the exit status."""
    console = console or Console(stderr=True)
    selection = resolve_selection(request)
    local = LocalLaunch(target=request.target, target_args=request.target_args, module=request.module,
                        no_python=request.no_python, local_rank_arg=request.local_rank_arg,
                        master_addr=request.master_addr or "127.0.0.1", master_port=request.master_port,
                        nproc=request.num_gpus if request.num_gpus and request.num_gpus > 0 else None)
    if selection is None:
        if request.dry_run:
            console.print(f"zerotrain launch: no hostfile; would run {local.target} on this machine")
            return 0
        if request.hang_timeout or request.each_rank_log:
            return _launch_here_with_agent(request, local, console)
        return _launch_here(request, local, console)
    nodes = plan_nodes(selection)
    multi = (request.force_multi or len(nodes) > 1 or request.no_ssh or request.launcher in ("slurm",)
             or not is_this_machine(nodes[0].host))
    if not multi and request.launcher in ("ssh", "pdsh"):
        # One node, this machine, and no --force_multi: run here, on the selected slots, as DeepSpeed
        # does. A single host that is another machine is started there, over ssh, like several.
        (slots,) = selection.values()
        if request.dry_run:
            _print_plan(nodes, f"{local.master_addr}:{local.master_port or DEFAULT_MASTER_PORT}", console)
            console.print(f"zerotrain launch: would run {local.target} on this machine ({nodes[0].host}), "
                          f"{len(slots)} processes; nothing started (--dry_run)")
            return 0
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, slots)))
        return _launch_here(request, dataclasses.replace(local, nproc=len(slots)), console)
    check_target(local)
    via_ssh = request.launcher in ("ssh", "pdsh") and not request.no_ssh
    master_addr = request.master_addr or (resolved_address(nodes[0].host, request.ssh) if via_ssh else nodes[0].host)
    master_port = request.master_port or DEFAULT_MASTER_PORT
    env = _job_environment(request, console)
    job_id = os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]
    jobs = node_jobs(request, nodes, master_addr, master_port, env, job_id)
    if request.launcher in ("openmpi", "mpich", "impi"):
        return _launch_mpi(request, selection, jobs[0], console)
    sessions_argv = _session_commands(request, jobs, via_ssh)
    if request.dry_run:
        _print_plan(nodes, f"{master_addr}:{master_port}", console)
        for job, argv in sessions_argv:
            print(f"# node {job.node_rank} ({job.host})\n{shlex.join(argv)}")
            if via_ssh:
                print(f"# stdin: {job.to_json()}")
        return 0
    if via_ssh and not request.skip_preflight and not _preflight(request, nodes, master_addr, master_port, console):
        return 2
    console.print(f"[dim]zerotrain launch: job {job_id} on {len(nodes)} nodes, {world_size(nodes)} ranks, "
                  f"master {master_addr}:{master_port}[/]")
    return run_sessions(request, jobs, sessions_argv, via_ssh, console)


def is_this_machine(host: str) -> bool:
    """Whether a hostfile's host names this machine: localhost, its host name or a loopback
    address. Decided without DNS; any other name is another machine, reached over ssh."""
    if host in ("localhost", socket.gethostname(), socket.gethostname().split(".")[0]):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _launch_here(request: ClusterLaunch, local: LocalLaunch, console: Console) -> int:
    """One machine, the ranks under torch's agent in this process; --env flags apply here too."""
    from zerotrain.launcher.job_environment import parse_env_flags

    os.environ.update(parse_env_flags(request.env_flags))
    return launch_local(local, console)


def _launch_here_with_agent(request: ClusterLaunch, local: LocalLaunch, console: Console) -> int:
    """One machine through a node agent, for what only it offers: hang dumps and per-rank log files."""
    from zerotrain.launcher.local import choose_master_port, visible_gpu_count

    check_target(local)
    nproc = local.nproc or max(1, visible_gpu_count())
    node = Node(host=socket.gethostname(), slots=tuple(range(nproc)), node_rank=0, first_rank=0)
    port = choose_master_port(request.master_port)
    job_id = os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]
    (job,) = node_jobs(request, [node], local.master_addr, port, _job_environment(request, console), job_id)
    agent = [sys.executable, "-u", "-m", "zerotrain.launcher.node_agent"]
    return run_sessions(request, [job], [(job, agent)], True, console)


def _session_commands(request: ClusterLaunch, jobs: list[NodeJob], via_ssh: bool) -> list[tuple[NodeJob, list[str]]]:
    agent = [sys.executable, "-u", "-m", "zerotrain.launcher.node_agent"]
    if request.no_ssh:
        if request.node_rank < 0 or request.node_rank >= len(jobs):
            raise LaunchError(f"--no_ssh needs --node_rank between 0 and {len(jobs) - 1}: run the same command "
                              "on every node, each with its own --node_rank")
        job = jobs[request.node_rank]
        return [(job, [*agent, "--job", job.to_b64()])]
    if request.launcher == "slurm":
        from zerotrain.launcher.slurm import srun_argv

        job = dataclasses.replace(jobs[0], host="", node_rank=None, slots=None)
        argv = srun_argv(len(jobs), [*agent, "--job", job.to_b64()], nodelist=[j.host for j in jobs],
                         launcher_args=request.launcher_args)
        return [(job, argv)]
    return [(job, ssh_argv(job.host, agent_command(job), request.ssh)) for job in jobs]


def _preflight(request: ClusterLaunch, nodes: Sequence[Node], master_addr: str, master_port: int,
               console: Console) -> bool:
    from zerotrain.launcher.preflight import PreflightRequest, render_preflight, run_preflight

    kind = "module" if request.module else "program" if request.no_python else "script"
    report = run_preflight(PreflightRequest(
        nodes=nodes, python=sys.executable, cwd=os.getcwd(), target=request.target, target_kind=kind,
        master_addr=master_addr, master_port=master_port, ssh=request.ssh, world_size=world_size(nodes),
    ))
    if report.ok:
        for line in report.warnings():
            console.print(f"[yellow]zerotrain launch: {escape(line)}[/]")
        return True
    # Off a terminal (a log file, CI) rich would squeeze the table into 80 columns.
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(render_preflight(report))
    console.print("[bold red]zerotrain launch: pre-flight failed, nothing was started:[/]")
    for line in report.failures():
        console.print(f"  {escape(line)}", soft_wrap=True)
    console.print("[dim](--skip_preflight starts the job without these checks)[/]")
    return False


def run_sessions(request: ClusterLaunch, jobs: list[NodeJob], commands: list[tuple[NodeJob, list[str]]],
                 via_ssh: bool, console: Console) -> int:
    """Starts every node's session, streams their output, stops them all on failure or signal."""
    events: queue.Queue[NodeEvent | tuple] = queue.Queue()
    send_job = via_ssh
    sessions = [NodeSession(job, argv, events, send_job=send_job) for job, argv in commands]
    output = JobOutput(request.each_rank_log)
    pid_file = _save_pid() if request.save_pid else None
    handlers = _forward_signals(events)
    start = time.monotonic()
    interrupted: str | None = None
    failed_first: NodeSession | None = None
    stop_at: float | None = None
    try:
        for session in sessions:
            session.start()
        running = set(sessions)
        while running:
            try:
                event = events.get(timeout=0.2)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if isinstance(event, tuple):  # a signal to the launcher
                if event[0] == "dump":
                    _dump_stacks(sessions, console)
                elif stop_at is None:
                    interrupted = event[0]
                    stop_at = _stop_all(sessions, now)
            elif event is not None and event.kind == "line":
                if output.write(event.session.host, event.stream, event.text) is None:
                    event.session.own_lines.append(event.text)
            elif event is not None and event.kind == "exit":
                running.discard(event.session)
                if event.returncode != 0 and failed_first is None:
                    failed_first = event.session
                    if not request.elastic and stop_at is None:
                        stop_at = _stop_all(sessions, now)
            if request.hang_timeout and now - output.last_line_at > request.hang_timeout and stop_at is None:
                console.print(f"[yellow]zerotrain launch: no output for {request.hang_timeout:g} s; "
                              "every rank prints its Python stack[/]")
                _dump_stacks(sessions, console)
                output.last_line_at = now
            if stop_at is not None and now > stop_at:
                for session in running:
                    session.kill()
        while not events.empty():  # the last lines and results
            event = events.get()
            if isinstance(event, NodeEvent) and event.kind == "line":
                output.write(event.session.host, event.stream, event.text)
    finally:
        _restore_signals(handlers)
        output.close()
        if pid_file:
            _remove(pid_file)
    return summarize(sessions, time.monotonic() - start, console, via_ssh=via_ssh, elastic=request.elastic,
                     interrupted=interrupted, failed_first=failed_first)


def _stop_all(sessions: Sequence[NodeSession], now: float) -> float:
    for session in sessions:
        session.stop()
    return now + STOP_DEADLINE_S


def _dump_stacks(sessions: Sequence[NodeSession], console: Console) -> None:
    console.print("[yellow]zerotrain launch: asking every rank for its Python stack[/]")
    for session in sessions:
        session.dump_stacks()


def _forward_signals(events: queue.Queue) -> dict:
    """SIGINT/SIGTERM stop the job, SIGUSR1 dumps stacks: all handled by the main loop."""
    saved = {}
    for sig, name in ((signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM"), (signal.SIGUSR1, "dump")):
        saved[sig] = signal.signal(sig, lambda *_, name=name: events.put((name,)))
    return saved


def _restore_signals(saved: dict) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _save_pid() -> str:
    """DeepSpeed's --save_pid: /tmp/<launcher pid>.deepspeed holds the launcher's pid while it runs."""
    path = os.path.join("/tmp", f"{os.getpid()}.deepspeed")
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return path


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _launch_mpi(request: ClusterLaunch, selection: dict[str, list[int]], job: NodeJob, console: Console) -> int:
    """mpirun starts every rank itself; the engine reads its rank from the MPI variables."""
    import subprocess

    from zerotrain.launcher.mpi import mpirun_argv

    worker = ([request.target] if request.no_python else
              [sys.executable, "-u", *(["-m"] if request.module else []), request.target])
    env = {**job.env, "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port), JOB_ID_ENV: job.job_id}
    argv = mpirun_argv(request.launcher, selection, [*worker, *request.target_args], env,
                       launcher_args=request.launcher_args, hostfile=request.hostfile)
    if request.dry_run:
        print(shlex.join(argv))
        return 0
    console.print(f"[dim]zerotrain launch: {shlex.join(argv[:6])} ...[/]")
    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found: install {request.launcher}'s mpirun on every node, "
                          "or use --launcher ssh") from None
