"""The job's one log: every rank's lines as they arrive, prefixed `[host rank]`, and per-rank files.

Each node agent prefixes its ranks' lines (torch elastic's log-line prefix); lines
without that prefix come from the agent or from ssh and get `[host]`.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import IO, TextIO

RANK_LINE = re.compile(r"^\[(?P<host>[^\]\s]+) (?P<rank>\d+)\]: ?(?P<text>.*)$", re.DOTALL)


class JobOutput:
    """Writes node output to this terminal (stdout lines to stdout, stderr to stderr), and with
    `each_rank_log` also to DIR/<start time>_rank<N>.log, one file per rank as DeepSpeed names them."""

    def __init__(self, each_rank_log: str | None = None, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.each_rank_log = each_rank_log
        self._files: dict[int, IO[str]] = {}
        self._lock = threading.Lock()
        self._prefix = time.strftime("%Y%m%d%H%M%S")
        self.last_line_at = time.monotonic()
        if each_rank_log:
            if os.path.isfile(each_rank_log):
                raise NotADirectoryError(f"--enable_each_rank_log {each_rank_log} is a file; give a directory")
            os.makedirs(each_rank_log, exist_ok=True)

    def write(self, host: str, stream: str, text: str) -> int | None:
        """Shows one line from `host`; returns the rank it came from, None for the agent's own lines."""
        match = RANK_LINE.match(text)
        line = text if match else f"[{host}] {text}"
        with self._lock:
            self.last_line_at = time.monotonic()
            target = self.stderr if stream == "stderr" else self.stdout
            try:
                target.write(line + "\n")
                target.flush()
            except (BrokenPipeError, ValueError):
                pass
            if match and self.each_rank_log:
                self._rank_file(int(match["rank"])).write(match["text"] + "\n")
        return int(match["rank"]) if match else None

    def _rank_file(self, rank: int) -> IO[str]:
        if rank not in self._files:
            path = os.path.join(self.each_rank_log, f"{self._prefix}_rank{rank}.log")
            self._files[rank] = open(path, "a", buffering=1)
        return self._files[rank]

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
