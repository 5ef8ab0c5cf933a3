"""Why a bench job failed, in one line of its log: what `bench run` shows on the console and `bench report`
gives as a crash's reason.

The cause is the first line that looks like an error, not the last line: after the error, zerotrain
launch prints its own summary and hints ("(--skip_preflight starts the job without these checks)",
"wall time ..."), and on a multi-rank job the other ranks' errors follow the first one.

    Traceback (most recent call last):      -> its exception line, "ConnectionRefusedError: ..."
    RuntimeError: NCCL error ...            -> the line itself (an exception named ...Error/...Exception)
    ssh: connect to host h port 22: Connection refused, "zerotrain: error: ...", "ERROR ..." -> the line
    ... pre-flight failed, nothing was started:   -> the line under it, e.g. "h: ssh connection refused; ..."

A log with none of these gives its last line that is not one of zerotrain's hints.
"""

from __future__ import annotations

import re
from pathlib import Path

# `[host rank]: ` (a rank's line) or `[host] ` (the node agent's), as zerotrain launch prefixes them.
_LINE_PREFIX = re.compile(r"^\[[^\]\s]+(?: \d+)?\]:? ?")
_TRACEBACK = "Traceback (most recent call last)"
_ERROR = re.compile(
    r"^\s*[\w.]*(?:Error|Exception|Interrupt)\b"  # an exception line: "ConnectionRefusedError: [Errno 111] ..."
    r"|\b[\w.]*Error:|\berror:|\bERROR\b|\bFATAL\b|\bfatal:"  # argparse's "prog: error:", logging's ERROR
    r"|[Rr]efused|[Pp]ermission denied|[Nn]o such file|Segmentation fault|\bKilled\b"
)
# A heading whose cause is the line under it: launch's "pre-flight failed, nothing was started:".
_FAILED_HEADING = re.compile(r"\bfailed\b.*:$")
# Lines that are not the cause even when they name an error: warnings, and table rows (pre-flight's).
_NOT_A_CAUSE = re.compile(r"[Ww]arning\b|\S {2,}\S.* {2,}\S.* {2,}\S")
# What zerotrain launch (and torch) print after a failure: never the cause itself.
_HINT = re.compile(r"^\(.*\)$|^wall time |^To enable traceback see|^[─━-]{3,}")
_MAX_CHARS = 300


def _lines(log: Path) -> list[str]:
    lines = []
    for index, raw in enumerate(log.read_text(encoding="utf-8", errors="replace").splitlines()):
        if index == 0 and raw.startswith("$ "):
            continue  # bench run's record of the command: its words may say "error" without one
        line = _LINE_PREFIX.sub("", raw.rstrip())
        if line.strip():
            lines.append(line)
    return lines


def _exception_after(lines: list[str], start: int) -> str | None:
    """The exception line of the traceback that starts at `start`: its first unindented line after."""
    for line in lines[start + 1:]:
        if not line[0].isspace() and not line.startswith(_TRACEBACK):
            return line.strip()
    return None


def _shorten(line: str) -> str:
    return line if len(line) <= _MAX_CHARS else line[:_MAX_CHARS - 3] + "..."


def failure_reason(log: Path) -> str:
    """The cause of a failed job as its log `log` gives it: the first error line (see the module's docstring)."""
    try:
        lines = _lines(log)
    except OSError:
        return f"no {log.name} to say why"
    for index, line in enumerate(lines):
        if line.lstrip().startswith(_TRACEBACK):
            found = _exception_after(lines, index)
            if found:
                return _shorten(found)
        elif _FAILED_HEADING.search(line) and index + 1 < len(lines) and lines[index + 1][0].isspace():
            return _shorten(lines[index + 1].strip())
        elif _ERROR.search(line) and not _NOT_A_CAUSE.search(line):
            return _shorten(line.strip())
    others = [line.strip() for line in lines if not _HINT.search(line.strip())]
    if others:
        return _shorten(others[-1])
    return _shorten(lines[-1].strip()) if lines else f"{log.name} is empty"
