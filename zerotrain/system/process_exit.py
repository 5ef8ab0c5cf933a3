"""Ending a zerotrain process without the interpreter's module teardown.

A process that has imported torch and transformers spends 1-1.8 s after its last line tearing
down some 350,000 module objects, one by one (measured on 2 cores: `python -c "import torch,
transformers"` exits 1.5 s later than the same with `os._exit`). Nothing is left to do by then:
zerotrain writes every file through a context manager or `durable_files`, so what a normal exit
does besides freeing memory is waiting for threads, running the atexit handlers and flushing the
standard streams. `exit_now` does exactly those, in the interpreter's order, then leaves. Every
`zerotrain` command and every rank of `zerotrain train` ends through it; a user's own script
started by `zerotrain launch` exits as Python exits it (its files may rely on the teardown).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exits with `code` after what a normal exit does but the teardown: non-daemon threads are
    joined (with concurrent.futures' own exit hooks first), atexit handlers run, stdout and
    stderr are flushed."""
    if threading.current_thread() is threading.main_thread():
        # What Py_FinalizeEx calls first; private, but the only way to run the hooks
        # concurrent.futures registers with threading (not with atexit) to stop its workers.
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # a reader that went away or a closed stream: nothing more can be said there
    os._exit(code)


def exit_code_of(request: SystemExit) -> int:
    """The status Python exits with for `sys.exit(value)`; a message is printed to stderr, as Python does."""
    value = request.code
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def end_rank(status: int) -> NoReturn:
    """Ends a rank of zerotrain's own (a `zerotrain train` worker, a comm-benchmark rank) with `status`:
    a finished one through `exit_now`; a failed one through SystemExit, as before, so the launcher's
    bootstrap still notes when it failed and leaves a live process group alone."""
    if status == 0:
        exit_now(0)
    sys.exit(status)


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """Runs a process's `main` and ends the process with its status through `exit_now`.

    `sys.exit(...)` inside `main` (argparse's --help and usage errors) gives the same status
    Python would. An uncaught exception is left to Python (traceback, exit 1, normal teardown)."""
    try:
        code = main()
    except SystemExit as request:
        exit_now(exit_code_of(request))
    exit_now(0 if code is None else int(code))
