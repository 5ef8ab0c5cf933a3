"""Per-worker entry point that `zerotrain launch` starts in every rank.

The elastic agent runs, in each worker process::

    python -u .../zerotrain/launcher/bootstrap.py MODE LOCAL_RANK_ARG TARGET [ARGS...]

MODE is ``script`` or ``module``; LOCAL_RANK_ARG is ``local_rank`` or
``no_local_rank``. The bootstrap rebuilds ``sys.argv`` and ``sys.path`` the way
``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would have, inserts
``--local_rank=K`` right after the program name as DeepSpeed's launcher does,
and runs the target as ``__main__``.

It is started by file path, not as ``-m zerotrain.launcher.bootstrap``, so that
a worker does not import the zerotrain package (and everything it pulls in)
before the user's code decides to. It therefore imports nothing from zerotrain.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import signal
import sys
import time
from types import TracebackType

SCRIPT_MODE = "script"
MODULE_MODE = "module"
WITH_LOCAL_RANK = "local_rank"
WITHOUT_LOCAL_RANK = "no_local_rank"
# Folder (set by the launcher) where a failing rank notes when it failed.
FAILURE_TIMES_ENV = "ZEROTRAIN_FAILURE_TIMES_DIR"
# Exit status of a rank stopped by Ctrl-C, as a shell reports it (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
# Set by the launcher (--bind_cores_to_rank): pin each rank to its own share of the cores.
BIND_CORES_ENV = "ZEROTRAIN_BIND_CORES"
# The signal on which every rank prints the Python stack of each of its threads (hang help).
DUMP_STACKS_SIGNAL = signal.SIGUSR1
# How often a rank checks that its launcher still lives, and how long it may take to stop after.
PARENT_POLL_S = 0.5
PARENT_GONE_GRACE_S = 30.0


def build_bootstrap_args(target: str, target_args: list[str], *, module: bool, local_rank_arg: bool) -> list[str]:
    """Returns the argv (after the bootstrap's own path) that `main` expects."""
    mode = MODULE_MODE if module else SCRIPT_MODE
    rank_flag = WITH_LOCAL_RANK if local_rank_arg else WITHOUT_LOCAL_RANK
    return [mode, rank_flag, target, *target_args]


def _target_argv(program: str, args: list[str], local_rank_arg: bool) -> list[str]:
    if not local_rank_arg:
        return [program, *args]
    # DeepSpeed's launcher puts --local_rank first, before the user's own arguments.
    return [program, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]


def _put_first_on_sys_path(folder: str) -> None:
    """Puts `folder` where Python would have put the script's folder (sys.path[0])."""
    if getattr(sys.flags, "safe_path", False):
        return  # python -P / PYTHONSAFEPATH: Python adds no such folder, nor do we
    own_folder = os.path.dirname(os.path.realpath(__file__))
    # We were started as bootstrap.py, so sys.path[0] is our own folder: replace it.
    if sys.path and os.path.realpath(sys.path[0] or ".") == own_folder:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def prepare_target(argv: list[str]) -> tuple[bool, str]:
    """Sets sys.argv and sys.path as ``python [-m] TARGET ARGS`` would; returns (is_module, target).

    `argv` is MODE, LOCAL_RANK_ARG, TARGET, ARGS... (see `build_bootstrap_args`).
    """
    if len(argv) < 3 or argv[0] not in (SCRIPT_MODE, MODULE_MODE) or argv[1] not in (
        WITH_LOCAL_RANK,
        WITHOUT_LOCAL_RANK,
    ):
        raise SystemExit(f"zerotrain bootstrap: unexpected arguments {argv!r}")
    is_module, target, args = argv[0] == MODULE_MODE, argv[2], argv[3:]
    # `python -m mod` puts the working directory first; `python script.py` the script's real folder.
    _put_first_on_sys_path(os.getcwd() if is_module else os.path.dirname(os.path.realpath(target)))
    # For a module, run_module replaces argv[0] with the module's file, as `python -m` does.
    sys.argv = _target_argv(target, args, argv[1] == WITH_LOCAL_RANK)
    return is_module, target


def run_target(is_module: bool, target: str) -> None:
    """Runs the script or module as ``__main__``, with sys.argv already set by `prepare_target`."""
    if is_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its leading frames from this file, runpy and torch's ``record``."""
    from torch.distributed.elastic.multiprocessing import errors

    internal = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), os.path.abspath(errors.__file__)}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != "<frozen runpy>" and os.path.abspath(filename) not in internal:
            break
        tb = tb.tb_next
    return tb


def _note_failure_time() -> None:
    """Leaves this rank's failure time, to the nanosecond, where the launcher looks for it.

    The agent's own failure timestamps have one-second resolution, too coarse to
    tell the rank that raised from the peers whose collectives broke a moment
    later; the launcher orders failures by these times to name the first.
    """
    folder = os.environ.get(FAILURE_TIMES_ENV)
    if not folder or not os.path.isdir(folder):
        return
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}")
    try:
        with open(path, "w") as f:
            f.write(str(time.time_ns()))
    except OSError:
        pass  # best effort: the summary then falls back on the agent's timestamps


def _end_failed_rank(code: int) -> None:
    """Exits a failed rank with `code`, without tearing down a live process group.

    Interpreter shutdown destroys the process group, and with peers blocked in a
    collective that can abort (Gloo: "terminate called without an active
    exception") or hang (NCCL) — then the agent never sees this rank exit and the
    job hangs. So: flush, run the atexit handlers, and leave at once.
    """
    # Python's own record of an unhandled error: atexit hooks (zerotrain's teardown) read it
    # and leave the process group alone, as they would after `python script.py` failed.
    sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(code)


def bind_cores_to_rank() -> None:
    """Pins this rank to its contiguous share of the cores it may use, and sizes OpenMP to match.

    Runs before torch is imported, so OMP_NUM_THREADS still takes effect.
    """
    if os.environ.get(BIND_CORES_ENV) != "1" or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    local_size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    share = max(1, len(cores) // local_size)
    mine = cores[local_rank * share:(local_rank + 1) * share] or [cores[local_rank % len(cores)]]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))


def watch_parent(interval_s: float = PARENT_POLL_S, grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """Stops this rank when the process that started it is gone.

    A launcher killed with SIGKILL (or an ssh session that dropped) cannot stop its ranks; left
    alone they would run, or wait in a collective, forever. The rank is then re-parented, which a
    daemon thread notices: it sends this rank SIGTERM (a `zerotrain train` rank saves a checkpoint
    and leaves), then SIGKILL if it is still there after `grace_s`.
    """
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zerotrain-parent-watch", daemon=True).start()


def main() -> None:
    """Worker entry: runs the target under torch elastic's ``record``.

    ``record`` writes the exception to the error file the agent gave this worker,
    so the launcher can show the failing rank's error in its summary. The
    traceback printed on stderr starts at the user's code: the frames of this
    bootstrap are noise to someone debugging their training script.
    """
    # Before importing torch, so that everything imports as under `python TARGET`.
    is_module, target = prepare_target(sys.argv[1:])
    bind_cores_to_rank()
    # `zerotrain launch` sends this signal when asked where a job hangs.
    faulthandler.register(DUMP_STACKS_SIGNAL, all_threads=True)
    watch_parent()
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(run_target)(is_module, target)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank; one quiet exit each instead of N tracebacks.
        _end_failed_rank(INTERRUPTED_EXIT_CODE)
    except SystemExit as exit_request:
        if exit_request.code in (None, 0):
            raise
        _note_failure_time()
        if not isinstance(exit_request.code, int):
            print(exit_request.code, file=sys.stderr)  # what Python does with sys.exit("message")
        _end_failed_rank(exit_request.code if isinstance(exit_request.code, int) else 1)
    except Exception as error:  # noqa: BLE001 - every error of the user's code ends here
        _note_failure_time()
        # sys.excepthook, not traceback.print_exc: torch installs a hook that
        # prefixes each line with the rank once a process group exists. The
        # default hook prints error.__traceback__, whatever tb it is handed.
        error = error.with_traceback(_user_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        _end_failed_rank(1)


if __name__ == "__main__":
    main()
