"""Running a training job in the background, watching it, and stopping it cleanly.

A run directory holds what these commands share:

    train.log   everything the run prints (written by the detached process)
    train.pid   the pid of the top `zerotrain train` process while it runs
    train.started  written once every rank is up (engine built); `--detach` waits for it
    STOP        present when a stop was asked for; the trainer checkpoints and exits

`--detach` starts the run in a new session (no controlling terminal, so closing
the terminal or an SSH disconnect does not send it SIGHUP) with its output in
train.log; no tmux or nohup needed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence
from zerotrain.config.errors import UserInputError
from zerotrain.system.durable_files import atomic_write_text
from zerotrain.system.processes import process_alive

LOG_NAME, PID_NAME, STOP_NAME, STARTED_NAME = "train.log", "train.pid", "STOP", "train.started"
# A second Ctrl-C this long after the first stops at once, without the checkpoint. Sooner
# ones are the same keypress reaching us twice (the launcher forwards it to every rank).
FORCE_AFTER_S = 2.0


class RunControlError(UserInputError):
    """A request about a run directory that cannot be carried out (no run there, already running)."""


def running_pid(run_dir: Path) -> int | None:
    """The pid of the run active in `run_dir`, or None (a stale pid file counts as none)."""
    try:
        pid = int((run_dir / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid) else None


def write_pid(run_dir: Path, pid: int | None = None) -> None:
    """Records the run's pid (atomically: a reader never sees half a number)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / PID_NAME, f"{pid or os.getpid()}\n")


def clear_pid(run_dir: Path) -> None:
    """Removes the pid file if it is this process's."""
    path = run_dir / PID_NAME
    try:
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def detach(run_dir: Path, train_argv: Sequence[str]) -> subprocess.Popen:
    """Starts `zerotrain train ARGV` in the background, output to run_dir/train.log; returns the process."""
    active = running_pid(run_dir)
    if active is not None:
        raise RunControlError(
            f"a run is already active in {run_dir} (pid {active}); follow it with `zerotrain logs {shlex.quote(str(run_dir))} -f`, "
            f"stop it with `zerotrain stop {shlex.quote(str(run_dir))}`, or set another output.dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_NAME).unlink(missing_ok=True)
    (run_dir / STARTED_NAME).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ZEROTRAIN_DETACHED": "1"}
    with open(run_dir / LOG_NAME, "ab") as log:
        child = subprocess.Popen(  # an argv list, never a shell string: nothing is interpreted
            [sys.executable, "-m", "zerotrain", "train", *train_argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, close_fds=True,
        )
    write_pid(run_dir, child.pid)
    return child


def mark_started(run_dir: Path) -> None:
    """Called by rank 0 once every rank has built its engine: the run is up."""
    (run_dir / STARTED_NAME).write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def wait_until_started(run_dir: Path, child: subprocess.Popen, timeout_s: float, poll_s: float = 0.2) -> int | None:
    """Waits for the detached run to be up; returns None once it is (or still starting at
    `timeout_s`), or its exit status if it ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = child.poll()
        if code is not None:
            return code
        if (run_dir / STARTED_NAME).exists():
            return None
        time.sleep(poll_s)
    return None


def log_tail(run_dir: Path, lines: int = 25) -> str:
    """The last lines of run_dir/train.log (what a failed detached start printed)."""
    try:
        text = (run_dir / LOG_NAME).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def follow_log(run_dir: Path, follow: bool, out=None, poll_s: float = 0.5) -> int:
    """Prints run_dir/train.log; with `follow`, keeps printing until the run ends (or Ctrl-C)."""
    out = out or sys.stdout
    path = run_dir / LOG_NAME
    if not path.exists():
        raise RunControlError(f"no log at {path}: logs are written by runs started with `zerotrain train --detach`")
    with open(path, "r", errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
            if not follow:
                return 0
            if running_pid(run_dir) is None:
                out.write(f.read())  # what was written between the last read and the exit
                return 0
            try:
                time.sleep(poll_s)
            except KeyboardInterrupt:
                return 0


def request_stop(run_dir: Path, wait_s: float = 600.0, on_wait=None) -> bool:
    """Asks the run in `run_dir` to checkpoint and exit; returns True once it has exited.

    The trainer polls for the STOP file every step, so the stop lands after the step in
    progress and one checkpoint save. `on_wait(elapsed_s)` is called while waiting.
    """
    pid = running_pid(run_dir)
    if pid is None:
        raise RunControlError(f"no run is active in {run_dir} (no live process in {run_dir / PID_NAME})")
    (run_dir / STOP_NAME).write_text(f"stop requested at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    start = time.monotonic()
    # Wait for the process itself: it removes its pid file a moment before it exits.
    while process_alive(pid):
        elapsed = time.monotonic() - start
        if elapsed > wait_s:
            return False
        if on_wait is not None:
            on_wait(elapsed)
        time.sleep(0.5)
    return True


class StopSignal:
    """Turns Ctrl-C, SIGTERM (e.g. Slurm's pre-emption notice) and the STOP file into one stop request.

    The trainer finishes the step in progress, checkpoints and exits. `arm()` installs the
    handlers once training starts: before that, Ctrl-C interrupts at once (nothing to save).
    """

    def __init__(self, run_dir: Path) -> None:
        self.stop_file = run_dir / STOP_NAME
        self.signal_name: str | None = None  # "SIGINT" / "SIGTERM" once one arrived
        self._first_at: float | None = None
        self._previous: dict = {}

    def arm(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:
                pass  # not the main thread (e.g. under a test runner): the STOP file still works

    def disarm(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at, self.signal_name = now, signal.Signals(signum).name
        elif now - self._first_at > FORCE_AFTER_S and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked again: stop now, without waiting for the checkpoint

    @property
    def signalled(self) -> bool:
        return self.signal_name is not None

    def requested_here(self) -> bool:
        return self.signalled or self.stop_file.exists()

    def consume(self) -> None:
        """Forgets a handled request, so the next run in this directory does not stop at once."""
        self.stop_file.unlink(missing_ok=True)
