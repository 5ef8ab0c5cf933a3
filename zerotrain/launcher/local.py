"""One-machine launcher: starts N worker processes under torch's elastic agent.

This is what `zerotrain launch` runs. The agent (the engine behind ``torchrun``)
gives every worker RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT,
watches them, stops all of them as soon as one fails, and forwards Ctrl-C.
We drive it through torchrun's own command-line parser because those flags are
the interface torch keeps stable across releases (2.5 through 2.13), whereas
``LaunchConfig``'s fields change from release to release.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from zerotrain.launcher import bootstrap
from zerotrain.launcher.failures import read_failure_times, report_failure
from zerotrain.config.errors import UserInputError

DEFAULT_MASTER_ADDR = "127.0.0.1"
# DeepSpeed's and torchrun's default rendezvous port: a multi-node job's, when none is given. A job on
# one machine without --master_port takes a port the operating system picks as it binds it (held_rendezvous_port).
DEFAULT_MASTER_PORT = 29500
# Seconds between the agent's checks on its workers; short, so a failed rank
# stops the job within a fraction of a second rather than the old default of 5 s.
MONITOR_INTERVAL_S = 0.1


class LaunchError(UserInputError):
    """A problem with the launch request, found before any worker started."""


@dataclass(frozen=True)
class LocalLaunch:
    """What to run, and how many copies: the parsed `zerotrain launch` request."""

    target: str
    target_args: Sequence[str] = field(default_factory=tuple)
    nproc: int | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    module: bool = False
    no_python: bool = False
    local_rank_arg: bool = True


def visible_gpu_count() -> int:
    """Number of CUDA GPUs this process can see (0 on a CPU-only machine or torch build)."""
    import torch

    return torch.cuda.device_count()


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on `port` on every interface of this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option the store uses, so a port in TIME_WAIT is not reported as busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def pick_free_port() -> int:
    """A port the operating system says is free now (it may be taken again before we use it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def choose_master_port(requested: int | None) -> int:
    """The rendezvous port of a one-machine job whose store another process binds (a node agent's):
    the user's, else one free now. Not 29500: jobs started together would all aim at it."""
    if requested is not None:
        _check_port_range(requested)
        if not port_is_free(requested):
            raise LaunchError(_port_in_use(requested))
        return requested
    return pick_free_port()


def _check_port_range(port: int) -> None:
    if not 0 < port < 65536:
        raise LaunchError(f"--master_port must be between 1 and 65535, got {port}")


def _port_in_use(port: int) -> str:
    return (f"--master_port {port} is already in use on this machine "
            "(another job still running?); choose another port or leave it out to pick a free one")


@contextlib.contextmanager
def held_rendezvous_port(requested: int | None) -> Iterator[int]:
    """The rendezvous port, bound by this process for as long as the job runs: `requested`
    exactly (LaunchError if it is out of range or taken), else one the operating system picks.

    A port checked free and bound later can be taken in between: two jobs started together both
    saw 29500 free and one died with EADDRINUSE. Here binding is the check. The store is
    multi-tenant, so torch's static rendezvous in this process, asked for the same port, shares
    this server instead of binding again, and the workers connect to it as clients (the agent's
    store, TORCHELASTIC_USE_AGENT_STORE), as they did to the server the agent used to bind.
    """
    import datetime

    import torch.distributed as dist

    if requested is not None:
        _check_port_range(requested)
    try:
        store = dist.TCPStore(DEFAULT_MASTER_ADDR, requested or 0, None, True, datetime.timedelta(seconds=60),
                              wait_for_workers=False, multi_tenant=True)
    except RuntimeError as error:  # DistNetworkError: EADDRINUSE
        if requested is None:
            raise
        raise LaunchError(_port_in_use(requested)) from error
    try:
        yield int(store.port)
    finally:
        del store  # the server closes, freeing the port, once the agent's handle on it is gone too


def check_target(launch: LocalLaunch) -> None:
    """Raises LaunchError if the script, module or program to run cannot be found."""
    if launch.module and launch.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if launch.no_python:
        if shutil.which(launch.target) is None:
            raise LaunchError(f"program not found or not executable: {launch.target}")
    elif launch.module:
        top_level = launch.target.split(".")[0]
        if not module_importable(top_level):
            raise LaunchError(
                f"no module named {top_level!r}: not in the working directory ({os.getcwd()}) nor installed in "
                f"this Python ({sys.executable}); run from the folder that holds it, or pip install it"
            )
    elif not os.path.isfile(launch.target):
        raise LaunchError(f"script not found: {launch.target}")


def module_importable(name: str) -> bool:
    """Whether `python -m NAME` started here would find NAME, as the worker will look for it.

    Asks the full import system, so editable installs (whose finders live on sys.meta_path,
    invisible to a sys.path scan) are found, with the working directory first as `python -m` puts it.
    """
    if name in sys.modules:
        return True
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved
        importlib.invalidate_caches()


def worker_command(
    target: str, target_args: Sequence[str], *, module: bool, no_python: bool, local_rank_arg: bool
) -> list[str]:
    """What torchrun runs in each worker, after its own flags: our bootstrap (or the program)."""
    if no_python:
        from torch.distributed.elastic.utils import macros

        # The agent replaces the ${local_rank} macro in each worker's arguments.
        rank_arg = [f"--local_rank={macros.local_rank}"] if local_rank_arg else []
        return ["--no_python", target, *rank_arg, *target_args]
    bootstrap_args = bootstrap.build_bootstrap_args(
        target, list(target_args), module=module, local_rank_arg=local_rank_arg
    )
    return [os.path.abspath(bootstrap.__file__), *bootstrap_args]


def torchrun_argv(launch: LocalLaunch, nproc: int, master_port: int) -> list[str]:
    """The torchrun command line that runs `launch` on this machine alone.

    Underscore spellings are used because every torch release since 1.9 accepts them.
    """
    argv = [
        "--nnodes=1",
        "--node_rank=0",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=static",
        f"--master_addr={launch.master_addr}",
        f"--master_port={master_port}",
        "--max_restarts=0",
        f"--monitor_interval={MONITOR_INTERVAL_S}",
    ]
    return argv + worker_command(
        launch.target, launch.target_args, module=launch.module, no_python=launch.no_python,
        local_rank_arg=launch.local_rank_arg,
    )


@contextlib.contextmanager
def quiet_agent_logs() -> Iterator[None]:
    """Silences the agent's own log lines while it runs, unless the user set LOGLEVEL.

    On a failure the agent logs pids, binaries and SIGTERMs; our summary says
    the same in user terms. LOGLEVEL is torch elastic's switch for its logs, so
    a user who sets it to debug the launcher still gets them.
    """
    if "LOGLEVEL" in os.environ:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    loggers = [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith(prefixes)
    ]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


@contextlib.contextmanager
def _worker_environment(nproc: int, failure_times_dir: str) -> Iterator[None]:
    """Sets the variables the workers inherit from us for the duration of the job."""
    from zerotrain.launcher.node_job import JOB_ID_ENV

    # The job id lets SIGUSR1 (dump stacks) find exactly this job's ranks.
    added = {bootstrap.FAILURE_TIMES_ENV: failure_times_dir, JOB_ID_ENV: os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]}
    if "OMP_NUM_THREADS" not in os.environ:
        # Every rank gets the same share of the cores; setting it ourselves also
        # keeps torchrun from printing its own OMP_NUM_THREADS warning.
        added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _stacks_on_sigusr1() -> Iterator[None]:
    """SIGUSR1 to the launcher: every rank prints its Python stack (the bootstrap's faulthandler)."""
    from zerotrain.launcher.job_processes import job_processes, signal_processes
    from zerotrain.launcher.node_job import JOB_ID_ENV

    job_id = os.environ[JOB_ID_ENV]
    saved = signal.signal(signal.SIGUSR1, lambda *_: signal_processes(job_processes(job_id), bootstrap.DUMP_STACKS_SIGNAL))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, saved)


def launch_local(launch: LocalLaunch, console: Console | None = None, quiet_interrupt: bool = False) -> int:
    """Runs `launch` as `nproc` local worker processes and returns the job's exit status.

    0 when every rank exits 0; the first failing rank's exit code (or 1) when one
    fails, after the agent has stopped the others; 130 on Ctrl-C. Raises
    LaunchError for a bad request, before anything starts. `quiet_interrupt`: the
    workers report a Ctrl-C/SIGTERM themselves (`zerotrain train` checkpoints and
    says how to resume), so the launcher adds no line of its own.
    """
    console = console or Console(stderr=True)
    check_target(launch)
    gpus = visible_gpu_count()
    nproc = max(1, gpus) if launch.nproc is None else launch.nproc
    if nproc < 1:
        raise LaunchError(f"the number of processes must be at least 1, got {nproc}")
    with held_rendezvous_port(launch.master_port) as master_port:
        return _run_agent(launch, nproc, gpus, master_port, console, quiet_interrupt)


def _run_agent(launch: LocalLaunch, nproc: int, gpus: int, master_port: int, console: Console,
               quiet_interrupt: bool) -> int:
    """torch's elastic agent, in this process, running `launch`'s workers; the job's exit status."""
    # Imported here: torch.distributed.run is slow to import and `--help` should not pay for it.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    console.print(
        f"[dim]zerotrain launch: {nproc} process{'es' if nproc > 1 else ''} "
        f"({'GPU' if gpus else 'CPU, Gloo'}), master {launch.master_addr}:{master_port}[/]"
    )
    failure_times_dir = tempfile.mkdtemp(prefix="zerotrain-launch-")
    try:
        with _worker_environment(nproc, failure_times_dir), quiet_agent_logs(), _stacks_on_sigusr1():
            run(parse_args(torchrun_argv(launch, nproc, master_port)))
    except ChildFailedError as error:
        codes = {failure.exitcode for failure in (getattr(error, "failures", None) or {}).values()}
        if quiet_interrupt and codes == {bootstrap.INTERRUPTED_EXIT_CODE}:
            return bootstrap.INTERRUPTED_EXIT_CODE  # every rank stopped cleanly on a signal and said so
        return report_failure(error, console, read_failure_times(failure_times_dir))
    except (SignalException, KeyboardInterrupt) as error:
        # The agent has already stopped every worker with the same signal.
        sigval = getattr(error, "sigval", signal.SIGINT)
        if quiet_interrupt:
            return bootstrap.INTERRUPTED_EXIT_CODE
        console.print(f"[yellow]zerotrain launch: interrupted ({signal.Signals(sigval).name}), all ranks stopped[/]")
        return 128 + int(sigval)
    except Exception as error:  # noqa: BLE001 - e.g. the rendezvous port was taken meanwhile
        console.print(f"[bold red]zerotrain launch: could not run the workers:[/] {escape(repr(error))}")
        return 1
    finally:
        shutil.rmtree(failure_times_dir, ignore_errors=True)
    return 0
