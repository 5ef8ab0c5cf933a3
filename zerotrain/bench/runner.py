"""`zerotrain bench run`: one `zerotrain launch` per hostfile, all at once, each stopped at the timeout.

Every job is a `zerotrain launch` of its own (with its pre-flight) in its own process group,
tagged with ZEROTRAIN_JOB_ID=bench-RUN-JOB so its node agents end every process it started.
The folder it writes is described in run_dir.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console

from zerotrain.bench import run_dir
from zerotrain.bench.failure import failure_reason
from zerotrain.bench.job_target import job_target
from zerotrain.bench.run_dir import JobStatus
from zerotrain.bench.run_progress import LogWatcher, RunProgress
from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
from zerotrain.launcher.hostfile import HostfileError, parse_hostfile
from zerotrain.launcher.local import LaunchError
from zerotrain.system.durable_files import atomic_write_text

COMMAND = "zerotrain bench run"
DEFAULT_GRACE_S = 15.0
POLL_S = 0.5
# Launch flags bench run sets itself, per job: given by hand they would be the same for every job.
_OWN_LAUNCH_FLAGS = {"help", "hostfile", "master_port", "master_addr"}


class BenchRunError(LaunchError):
    """A bench run that cannot start: the message names the file or flag and the fix."""


class _JobAfterDoubleDash(argparse.ArgumentParser):
    """Parses what comes before the first `--`; everything after it is the job, word for word.

    argparse alone cannot: a `*` positional after HOSTFILE_DIR is taken (empty) before the flags.
    """

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        head, tail = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        namespace, extras = super().parse_known_args(head, namespace)
        namespace.job = tail
        return namespace, extras


def _launch_flag_actions() -> list[argparse.Action]:
    """`zerotrain launch`'s own flag definitions, less those bench run sets per job."""
    from zerotrain.launcher.launch_command import add_launch_flags

    return add_launch_flags(argparse.ArgumentParser(add_help=False), skip=_OWN_LAUNCH_FLAGS)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `run` to `zerotrain bench`."""
    parser = commands.add_parser(
        "run", help="run a job on every hostfile of a folder at once, each stopped at a timeout",
        usage="%(prog)s HOSTFILE_DIR --timeout S --out RUN_DIR [zerotrain launch flags] "
              "(-- SCRIPT [ARGS...] | --workload NAME)",
        description="Run the same job (what `zerotrain launch` would run: a script, or `--module zerotrain train "
        "my.yaml`) on every hostfile in HOSTFILE_DIR at once, each through its own `zerotrain launch` (with its "
        "pre-flight) and its own master port. A job still running at --timeout is stopped on every node. Logs "
        "and each job's status go to RUN_DIR/JOB/; `zerotrain bench report RUN_DIR` gives the verdicts. "
        "Exit status: 0 when every job exited 0, else 1.",
    )
    parser.__class__ = _JobAfterDoubleDash  # same parser, `--` handled as above
    add = parser.add_argument
    add("hostfile_dir", metavar="HOSTFILE_DIR", help="folder of hostfiles, one job each (e.g. from bench split)")
    add("--timeout", type=float, required=True, metavar="S", help="stop a job still running after S seconds")
    add("--out", required=True, metavar="RUN_DIR", help="new or empty folder for the logs and status files")
    add("--workload", default=None, metavar="NAME",
        help="a built-in workload instead of `-- SCRIPT`: llama-cpu (sized for CPUs), llama-125m, llama-350m "
        "or llama-1b (docs/bench.md)")
    add("--grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
        help="after SIGTERM, seconds a stopped job gets before SIGKILL (default: %(default)s)")
    add("--master_port", type=int, default=None, metavar="PORT",
        help="first job's master port, the next job PORT+1, ... (default: a free port each)")
    group = parser.add_argument_group("zerotrain launch flags", "passed to every job's `zerotrain launch`")
    from zerotrain.launcher.launch_command import add_launch_flags

    add_launch_flags(group, skip=_OWN_LAUNCH_FLAGS)  # those are set per job (--master_port: the first job's)
    parser.set_defaults(handler=run_bench, job=[])


def launch_flags(args: argparse.Namespace) -> list[str]:
    """The `zerotrain launch` flags given to bench run, as words to pass on (`--flag=value` keeps '-F x' whole)."""
    words: list[str] = []
    for action in _launch_flag_actions():
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            words += [f"{flag}={item}" for item in value]
        else:
            words.append(f"{flag}={value}")
    # One node must still run on that node, not here: DeepSpeed runs a one-host hostfile locally.
    return words if "--force_multi" in words else [*words, "--force_multi"]


def find_jobs(hostfile_dir: Path) -> dict[str, tuple[Path, list[str]]]:
    """Job name -> (hostfile, its hosts), for every hostfile in the folder; errors name the file to fix."""
    if not hostfile_dir.is_dir():
        raise BenchRunError(f"{hostfile_dir} is not a folder; give the folder of hostfiles "
                            "(`zerotrain bench split NODES.txt DIR --nodes-per-job K` writes one)")
    jobs: dict[str, tuple[Path, list[str]]] = {}
    owner: dict[str, Path] = {}
    for path in sorted(p for p in hostfile_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
        try:
            hosts = list(parse_hostfile(path))
        except HostfileError as error:
            raise BenchRunError(f"{path} is not a hostfile: {error} (every file in {hostfile_dir} is a job; "
                                "move other files out)") from None
        if path.stem in jobs:
            raise BenchRunError(f"{path} and {jobs[path.stem][0]} would both be job {path.stem}; rename one")
        for host in hosts:
            if host in owner:
                raise BenchRunError(f"node {host} is in both {owner[host]} and {path}; jobs run at once, so "
                                    "each node may be in one hostfile only")
            owner[host] = path
        jobs[path.stem] = (path, hosts)
    if not jobs:
        raise BenchRunError(f"{hostfile_dir} holds no hostfiles; write some with "
                            f"`zerotrain bench split NODES.txt {hostfile_dir} --nodes-per-job K`")
    return jobs


def _free_ports(count: int, first: int | None) -> list[int]:
    if first is not None:
        return [first + i for i in range(count)]
    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("", 0))
            ports.add(probe.getsockname()[1])
    return sorted(ports)


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _die_with_parent():
    """For each job's launcher: SIGTERM when bench run dies, even by SIGKILL, so no job outlives it (Linux).

    libc is loaded here, before the fork: the child only makes the call.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass
class Job:
    """One hostfile's launch while the run goes on."""

    status: JobStatus
    dir: Path
    argv: list[str]
    env: dict[str, str]
    log: LogWatcher
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    stopped_at: float | None = None
    stop_reason: str | None = None
    killed: bool = False

    def start(self) -> None:
        with (self.dir / run_dir.LOG_FILE).open("wb") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            # Own session: a Ctrl-C at the terminal reaches bench run only, which stops each job itself.
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, preexec_fn=_die_with_parent())
        self.started_at = time.monotonic()
        self.status.state, self.status.started = "running", _now()
        self.status.write(self.dir)

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, reason: str, now: float) -> None:
        """SIGTERM to the launcher and its children: `zerotrain launch` then ends the job on every node."""
        if self.stopped_at is None:
            self.stopped_at, self.stop_reason = now, reason
            self.status.extra["stopped_by"] = reason
            self.signal_group(signal.SIGTERM)

    def check(self, now: float, timeout_s: float, grace_s: float) -> bool:
        """Looks at the job (timeout, grace, exit, log); True when its status changed."""
        changed = self.log.poll()
        self.status.extra["throughput"] = self.log.throughput
        self.status.elapsed_s = round(now - self.started_at, 1)
        code = self.process.poll()
        if code is None:
            if now - self.started_at >= timeout_s:
                self.stop("timeout", now)
            if self.stopped_at is not None and now - self.stopped_at >= grace_s and not self.killed:
                self.killed = True
                self.status.extra["killed"] = True
                self.signal_group(signal.SIGKILL)
            return changed
        if self.stopped_at is not None:
            self.signal_group(signal.SIGKILL)  # anything the launcher left behind in its group
        self.log.poll()
        self.status.extra["throughput"] = self.log.throughput
        self.status.ended = _now()
        if self.stop_reason == "timeout":
            self.status.state, self.status.exit_code = "timeout", None
            self.status.extra["launcher_exit_code"] = code
        else:
            self.status.state, self.status.exit_code = ("finished" if code == 0 else "failed"), code
        if self.status.state == "failed":  # what the console shows, as `bench report` will
            self.status.extra["reason"] = (f"stopped by {self.stop_reason}" if self.stop_reason
                                           else failure_reason(self.dir / run_dir.LOG_FILE))
        return True


def _prepare(args: argparse.Namespace) -> tuple[list[Job], dict]:
    if args.timeout <= 0 or args.grace < 0:
        raise BenchRunError(f"--timeout {args.timeout:g} / --grace {args.grace:g}: give a timeout above 0 seconds")
    if not args.job and not args.workload:
        raise BenchRunError("give the job to run after `--` (e.g. `-- train.py --lr 1e-4` or "
                            "`-- --module zerotrain train my.yaml`) or as --workload NAME")
    hostfile_dir, out = Path(args.hostfile_dir), Path(args.out)
    jobs_found = find_jobs(hostfile_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BenchRunError(f"--out {out} already exists and is not an empty folder; give a new folder for this run")
    workload_target = None
    if args.workload:
        try:
            from zerotrain.bench.workloads import workload_target
        except ImportError:
            raise BenchRunError("built-in workloads are not available in this zerotrain; give `-- SCRIPT`") from None
    flags, run_id = launch_flags(args), uuid.uuid4().hex[:8]
    ports = _free_ports(len(jobs_found), args.master_port)
    launcher = [sys.executable, "-m", "zerotrain", "launch"]
    jobs = []
    for (name, (hostfile, hosts)), port in zip(jobs_found.items(), ports):
        job_dir = out / name
        try:
            # with --workload, words after `--` are `zerotrain train` overrides: -- --training.max_steps 50
            words = [*workload_target(args.workload, job_dir.resolve()), *args.job] if workload_target else args.job
        except ValueError as error:
            raise BenchRunError(f"--workload {args.workload}: {error}") from None
        target = job_target(words, flags, job_dir.resolve())
        argv = [*launcher, "--hostfile", str((job_dir / run_dir.HOSTFILE).resolve()),
                "--master_port", str(port), *flags, *target]
        env = {**os.environ, "ZEROTRAIN_JOB_ID": f"bench-{run_id}-{name}"}
        status = JobStatus(job=name, nodes=hosts, master_port=port,
                           extra={"job_id": env["ZEROTRAIN_JOB_ID"], "hostfile_source": str(hostfile.resolve())})
        jobs.append(Job(status, job_dir, argv, env, LogWatcher(job_dir / run_dir.LOG_FILE)))
    run = {"run_id": run_id, "hostfile_dir": str(hostfile_dir.resolve()), "jobs": list(jobs_found),
           "command": shlex.join(["zerotrain", "launch", "--hostfile", "JOB/hostfile", "--master_port", "PORT",
                                  *flags, *([f"<workload {args.workload}>"] if args.workload else []), *args.job]),
           "launch_flags": flags, "target": args.job or None, "workload": args.workload, "timeout_s": args.timeout,
           "grace_s": args.grace, "cwd": os.getcwd(), "started": None, "ended": None, "exit_code": None}
    return jobs, run


def run_jobs(jobs: list[Job], timeout_s: float, grace_s: float, progress: RunProgress) -> str | None:
    """Runs every job at once until all have ended; returns the signal that interrupted the run, if one did."""
    interrupted: list[str] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: interrupted.append(signal.Signals(signum).name))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for job in jobs:
            job.start()
        running = list(jobs)
        while running:
            progress.update([job.status for job in jobs])
            time.sleep(POLL_S)
            now = time.monotonic()
            for job in list(running):
                if interrupted:
                    job.stop(interrupted[0], now)
                if job.check(now, timeout_s, grace_s):
                    job.status.write(job.dir)
                if job.status.ended is not None:
                    running.remove(job)
        progress.update([job.status for job in jobs])
    finally:
        for job in jobs:  # an error here must not leave jobs running unwatched
            if job.process is not None and job.process.poll() is None:
                job.signal_group(signal.SIGKILL)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return interrupted[0] if interrupted else None


def _logs(out: Path, jobs: list[Job], every: bool = False) -> str:
    """The jobs' log paths as the user can open them: all of them, or the first and last ('A ... Z')."""
    paths = [str(out / job.status.job / run_dir.LOG_FILE) for job in jobs]
    if every or len(paths) <= 2:
        return ", ".join(paths)
    return f"{paths[0]} ... {paths[-1]}"


def run_bench(args: argparse.Namespace) -> int:
    """`zerotrain bench run`: 0 when every job exited 0, 1 otherwise, 2 for a bad command, 130/143 if stopped."""
    try:
        jobs, run = _prepare(args)
        out = Path(args.out)
        for job in jobs:
            job.dir.mkdir(parents=True)
            shutil.copyfile(job.status.extra["hostfile_source"], job.dir / run_dir.HOSTFILE)
            job.status.write(job.dir)
    except (LaunchError, OSError) as error:
        print_user_error(COMMAND, error)
        return USAGE_EXIT_CODE
    run["started"] = _now()
    _write_json(out / run_dir.RUN_FILE, run)
    console = Console(soft_wrap=True, highlight=False)
    console.print(f"{COMMAND}: {len(jobs)} jobs, timeout {args.timeout:g} s, logs in {_logs(out, jobs)}")
    with RunProgress(console, args.timeout, out) as progress:
        interrupted = run_jobs(jobs, args.timeout, args.grace, progress)
    counts = {state: sum(job.status.state == state for job in jobs) for state in ("finished", "failed", "timeout")}
    code = 0 if counts["finished"] == len(jobs) else 1
    if interrupted:
        code = 128 + signal.Signals[interrupted].value
    run.update(ended=_now(), exit_code=code, counts=counts, interrupted_by=interrupted)
    _write_json(out / run_dir.RUN_FILE, run)
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    failed = [job for job in jobs if job.status.state == "failed"]
    console.print(f"{COMMAND}: {summary}" + (f" (stopped by {interrupted})" if interrupted else "")
                  + f"; logs in {_logs(out, jobs)}"
                  + (f"; failed: {_logs(out, failed, every=True)}" if failed else ""))
    console.print(f"next: zerotrain bench report {shlex.quote(str(out))} --threshold THROUGHPUT "
                  "(THROUGHPUT: the lowest samples/s a healthy job reaches)")
    return code
