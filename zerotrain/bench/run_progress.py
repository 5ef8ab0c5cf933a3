"""What `zerotrain bench run` shows while its jobs run: a live table on a terminal, one line per change on a pipe.

Each job's last throughput comes from its log, read a little at a time (only the bytes
added since the last look), so watching a hundred jobs costs next to nothing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from zerotrain.bench.run_dir import LOG_FILE, JobStatus

# Throughput as the common trainers print it. The last match on a line is the one shown, so a zerotrain
# line ("... 12,345 tok/s | 1.5 samples/s") shows samples/s. `bench report` does the real parsing.
def _number(name: str) -> str:
    return rf"(?P<{name}>\d[\d,]*(?:\.\d+)?)"  # "12,345" and "1.5"


THROUGHPUT = re.compile(
    rf"Throughput:\s*{_number('value')}(?:\s*(?P<unit1>samples|tokens|tok)/s(?:ec)?)?"  # a guide's scripts
    rf"|(?P<ds>SamplesPerSec)=\s*{_number('ds_value')}"  # DeepSpeed's throughput timer
    rf"|(?P<hf>train_samples_per_second)['\"]?\s*[:=]\s*{_number('hf_value')}"  # HF Trainer's summary
    rf"|{_number('plain_value')}\s*(?P<unit2>samples|tokens|tok)/s(?:ec)?\b",  # zerotrain train, and most others
    re.IGNORECASE,
)
# Reading more than this at once means the log grew fast: only its end matters.
_MAX_READ = 256 * 1024
_STATE_STYLE = {"pending": "dim", "running": "cyan", "finished": "green", "failed": "red", "timeout": "yellow"}


def _shown(match: re.Match) -> str:
    """A match as the table shows it: "1.5 samples/s", "12,345 tok/s", or "Throughput: 812" (unit unknown)."""
    if match["ds"] or match["hf"]:
        return f"{match['ds_value'] or match['hf_value']} samples/s"
    unit = (match["unit1"] or match["unit2"] or "").lower()
    value = match["value"] or match["plain_value"]
    if not unit:
        return f"Throughput: {value}"
    return f"{value} {'samples/s' if unit == 'samples' else 'tok/s'}"


def last_throughput(text: str) -> str | None:
    """The last throughput figure in `text`, e.g. "1.5 samples/s", or None."""
    found = None
    for line in text.splitlines():
        matches = list(THROUGHPUT.finditer(line))
        if matches:
            found = _shown(matches[-1])
    return found


class LogWatcher:
    """Follows one log file and remembers the last throughput line it saw."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.throughput: str | None = None
        self._offset = 0
        self._partial = ""

    def poll(self) -> bool:
        """Reads what was added to the log; True when the throughput shown changed."""
        try:
            with self.path.open("rb") as log:
                size = log.seek(0, 2)
                if size <= self._offset:
                    return False
                start = max(self._offset, size - _MAX_READ)
                log.seek(start)
                chunk = log.read(size - start).decode("utf-8", errors="replace")
        except OSError:
            return False
        # A line cut by a skipped stretch would be half of two lines: start afresh then.
        text = ("" if start > self._offset else self._partial) + chunk
        self._offset = size
        complete, _, self._partial = text.rpartition("\n")
        found = last_throughput(complete)
        if found is not None and found != self.throughput:
            self.throughput = found
            return True
        return False


def format_elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}" if minutes < 60 else f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def format_nodes(nodes: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(nodes[:most])
    return shown + (f" (+{len(nodes) - most})" if len(nodes) > most else "")


class RunProgress:
    """The jobs' progress: a rich Live table when `console` is a terminal, else a line per state change.

    Use as a context manager; call `update(statuses)` after each look at the jobs.
    """

    def __init__(self, console: Console, timeout_s: float, run_dir: Path | None = None) -> None:
        self.console = console
        self.timeout_s = timeout_s
        self.run_dir = run_dir  # as the user named it: a failed job's line names its log under it
        self._live: Live | None = None
        self._seen: dict[str, str] = {}
        self._started = time.monotonic()

    def __enter__(self) -> RunProgress:
        if self.console.is_terminal:
            # Refreshed by update() only: no refresh thread while the runner forks jobs.
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, statuses: Sequence[JobStatus]) -> None:
        if self._live is not None:
            self._live.update(self.table(statuses), refresh=True)
            return
        for status in statuses:
            if self._seen.get(status.job) != status.state:
                self._seen[status.job] = status.state
                log = self.run_dir / status.job / LOG_FILE if self.run_dir is not None else None
                self.console.print(self.change_line(status, log), soft_wrap=True, highlight=False)

    def table(self, statuses: Sequence[JobStatus]) -> Table:
        done = sum(s.state in ("finished", "failed", "timeout") for s in statuses)
        elapsed = format_elapsed(time.monotonic() - self._started)
        table = Table(title=f"zerotrain bench run: {done}/{len(statuses)} jobs done, {elapsed} "
                            f"(timeout {format_elapsed(self.timeout_s)})", title_justify="left")
        for name in ("job", "nodes", "state", "elapsed", "last throughput, or why it failed"):
            table.add_column(name, justify="right" if name == "elapsed" else "left")
        for status in statuses:
            style = _STATE_STYLE.get(status.state, "")
            last = status.extra.get("reason") if status.state == "failed" else None
            table.add_row(escape(status.job), escape(format_nodes(status.nodes)),
                          f"[{style}]{status.state}[/]" if style else status.state, format_elapsed(status.elapsed_s),
                          escape(last or status.extra.get("throughput") or "-"))
        return table

    @staticmethod
    def change_line(status: JobStatus, log: Path | None = None) -> str:
        """One plain line for a job's new state, e.g. `batch-002  127.0.0.12  failed (exit 1)  after 0:07`;
        a failed job's also says why (the first error line of its log) and names the log."""
        state = status.state
        if state == "running":
            state += f" (master port {status.master_port})"
        elif state == "failed" and status.exit_code is not None:
            state += f" (exit {status.exit_code})"
        words = [time.strftime("%H:%M:%S"), status.job, format_nodes(status.nodes), state]
        if status.state in ("finished", "failed", "timeout"):
            words.append(f"after {format_elapsed(status.elapsed_s)}")
            if status.extra.get("throughput"):
                words.append(f"last throughput {status.extra['throughput']}")
        if status.state == "failed" and status.extra.get("reason"):
            words.append(status.extra["reason"])
        if status.state in ("failed", "timeout") and log is not None:
            words.append(f"(log: {log})")
        return escape("  ".join(words))
