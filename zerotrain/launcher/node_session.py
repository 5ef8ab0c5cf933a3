"""One node's connection during a job: the process that reaches the node agent, and its output.

Over ssh the session's stdin is the agent's control channel: it carries the job
description, then `dump-stacks` requests; closing it ends the job on that node.
If the launcher dies, even by SIGKILL, the operating system closes that pipe for
it, ssh passes the end of input on, and the node agent ends the node's processes.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import IO

from zerotrain.launcher.node_job import DUMP_STACKS_COMMAND, RESULT_MARK, NodeJob


@dataclass
class NodeEvent:
    """Something that happened on a node: an output line, its result, or the end of its session."""

    session: NodeSession
    kind: str  # "line" | "result" | "exit"
    stream: str = "stdout"
    text: str = ""
    result: dict = field(default_factory=dict)
    returncode: int = 0


class NodeSession:
    """Runs `argv` (ssh to the node, or the agent itself) and reports what it does as NodeEvents."""

    def __init__(self, job: NodeJob, argv: list[str], events: queue.Queue, *, send_job: bool) -> None:
        self.job = job
        self.argv = argv
        self.events = events
        self.send_job = send_job
        self.result: dict | None = None
        self.returncode: int | None = None
        # Lines that are not a rank's (ssh's own errors, the agent's): kept to explain a failure.
        self.own_lines: deque[str] = deque(maxlen=40)
        self._process: subprocess.Popen | None = None
        self._stdin_lock = threading.Lock()

    @property
    def host(self) -> str:
        return self.job.host or "srun"  # one session starts every Slurm node's agent

    def start(self) -> None:
        self._process = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE if self.send_job else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, errors="replace",
        )
        if self.send_job:
            self.send(self.job.to_json())
        readers = [
            threading.Thread(target=self._read, args=(self._process.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._read, args=(self._process.stderr, "stderr"), daemon=True),
        ]
        for reader in readers:
            reader.start()
        threading.Thread(target=self._wait, args=(readers,), daemon=True).start()

    def send(self, line: str) -> None:
        """Writes one line to the agent's control channel (ignored once the node has ended)."""
        with self._stdin_lock:
            stdin = self._process.stdin if self._process else None
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(line + "\n")
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def dump_stacks(self) -> None:
        self.send(DUMP_STACKS_COMMAND)

    def stop(self) -> None:
        """Asks the node to end the job: closes its control channel (the agent ends its processes)."""
        with self._stdin_lock:
            stdin = self._process.stdin if self._process else None
            if stdin is not None and not stdin.closed:
                try:
                    stdin.close()
                except OSError:
                    pass
        if not self.send_job and self._process and self._process.poll() is None:
            self._process.terminate()  # srun/mpirun/local agent: they end their tasks on SIGTERM

    def kill(self) -> None:
        """Last resort, when the node did not end in time: ends the local end of the session."""
        if self._process and self._process.poll() is None:
            self._process.kill()

    def _read(self, pipe: IO[str], stream: str) -> None:
        for raw in pipe:
            line = raw.rstrip("\n")
            if line.startswith(RESULT_MARK):
                try:
                    self.result = json.loads(line[len(RESULT_MARK):])
                except ValueError:
                    continue
                self.events.put(NodeEvent(self, "result", result=self.result))
                continue
            self.events.put(NodeEvent(self, "line", stream=stream, text=line))

    def _wait(self, readers: list[threading.Thread]) -> None:
        assert self._process is not None
        code = self._process.wait()
        for reader in readers:
            reader.join(timeout=5)
        self.returncode = code
        self.events.put(NodeEvent(self, "exit", returncode=code))
