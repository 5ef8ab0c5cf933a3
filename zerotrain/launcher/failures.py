"""What `zerotrain launch` tells the user when a rank fails: which one first, and how.

When one rank fails, its peers usually fail a moment later (their collectives
lose a partner) and the agent stops the rest; the summary names the rank that
failed first, because that is where the traceback worth reading comes from.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

# Exit status for a job stopped by Ctrl-C, as a shell reports it (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
# How a rank ends when the agent (or the user) stops it: a consequence, never the cause.
_STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT)


def _message_of(failure: object, limit: int = 200) -> str:
    """The one-line error a worker recorded (``record`` stores a dict, older paths a string)."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    # The agent's placeholders when no error file was written (a docs link, or the
    # signal again) add nothing to the first line of the summary.
    if not text or text.startswith(("To enable traceback", "Signal ")):
        return ""
    line = text.splitlines()[-1]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _how_it_ended(exitcode: int, signal_name: str) -> str:
    return f"was killed by {signal_name}" if exitcode < 0 else f"exited with code {exitcode}"


def _exit_code_of(exitcode: int) -> int:
    """The launcher's exit status for a worker that exited with `exitcode` (negative: killed by a signal)."""
    if exitcode > 0:
        return min(exitcode, 255)
    if exitcode < 0:
        return min(128 - exitcode, 255)
    return 1


def read_failure_times(folder: str) -> dict[int, int]:
    """{rank: time_ns} as the bootstrap noted them in `folder` when a rank's code failed."""
    times: dict[int, int] = {}
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                times[int(name.removeprefix("rank"))] = int(f.read().strip())
        except (OSError, ValueError):
            continue
    return times


def order_failures(failures: Mapping[int, Any], failure_times: Mapping[int, int]) -> list[tuple[int, Any]]:
    """Failed ranks, most likely cause first.

    Ranks whose Python code failed are ordered by the time they noted; a rank
    that died without noting one (a native crash, a non-Python program) counts
    from the start of the second the agent saw it die, so it goes before the
    peers whose collectives broke because of it; ranks the agent stopped go last.
    """

    def key(item: tuple[int, Any]) -> tuple[float, int]:
        rank, failure = item
        if rank in failure_times:
            return (float(failure_times[rank]), rank)
        if failure.exitcode in _STOP_SIGNALS:
            return (math.inf, rank)
        return (failure.timestamp * 1e9, rank)

    return sorted(failures.items(), key=key)


def report_failure(error: BaseException, console: Console, failure_times: Mapping[int, int]) -> int:
    """Prints which rank failed first, how, and its error; returns the launcher's exit status."""
    failures = getattr(error, "failures", {}) or {}
    if not failures:
        console.print(Panel(escape(str(error)), title="zerotrain launch failed", border_style="red", expand=False))
        return 1
    (first_rank, first), *others = order_failures(failures, failure_times)
    if first.exitcode in (INTERRUPTED_EXIT_CODE, -signal.SIGINT):
        # Ctrl-C reached the ranks before the agent: an interruption, not a failure.
        console.print("[yellow]zerotrain launch: interrupted (SIGINT), all ranks stopped[/]")
        return INTERRUPTED_EXIT_CODE
    lines = [
        f"[bold]rank {first_rank}[/] (local rank {first.local_rank}, pid {first.pid}) "
        f"{_how_it_ended(first.exitcode, first.signal_name())}"
    ]
    detail = _message_of(first)
    if detail:
        lines.append(f"[red]{escape(detail)}[/]")
    failed_after = [rank for rank, f in others if f.exitcode not in _STOP_SIGNALS]
    if failed_after:
        lines.append("failed after it: " + ", ".join(f"rank {rank}" for rank in failed_after))
    lines.append("[dim]all ranks are stopped; each rank's own error output is above[/]")
    console.print(Panel("\n".join(lines), title="zerotrain launch failed", border_style="red", expand=False))
    return _exit_code_of(first.exitcode)
