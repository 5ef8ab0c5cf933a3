"""Starting the speed check's engine processes: one fresh process per engine, a world of one
(or one process per rank with `world`: the multi-GPU part, benchmarks/gpu/multi.py).

Process start and imports (torch, transformers, the engine: seconds each) are no part of what is
measured, so the next engine's process is started while the current one runs: it imports, then
waits for its "go" file before touching the device. Its timeout runs from the go. On a timeout
the process's whole session is killed (an engine may have started helpers). A process may run
several engines one after the other (speed.py --engines-per-process: the dry run's, where the
imports cost more than the engines).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
_T0 = time.perf_counter()


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the run started (the budget is what counts)."""
    print(f"[speed {time.perf_counter() - _T0:4.0f}s] {message}", flush=True)


class EngineProcess:
    """One worker process per rank, running its engines in turn, from its start (imports) through go to its
    results (rank 0 writes them; the other ranks log to `<name>.rank<r>.log`)."""

    def __init__(self, engines: list[str], modes: list[str], env: dict, settings_file: Path, logs: Path,
                 world: int = 1) -> None:
        self.engines, self.modes, self.logs = engines, modes, logs
        self.name = "+".join(engines)
        tag = "" if len(modes) > 1 else "." + modes[0]
        self.go_file = logs / f"{self.name}{tag}.go"
        self.log = logs / f"{self.name}{tag}.log"
        for path in [self.go_file, *(self.result_file(e, m) for e in engines for m in modes)]:
            path.unlink(missing_ok=True)
        with socket.socket() as s:  # a free port for this world's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, str(HERE / "speed.py"), "--worker", ",".join(engines), "--settings", str(settings_file),
               "--modes", ",".join(modes), "--result-dir", str(logs), "--go-file", str(self.go_file)]
        self.procs = []
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = self.log if rank == 0 else self.log.with_suffix(f".rank{rank}.log")
            with open(log, "w") as fh:
                # A session of its own, so a timeout can end the whole process group.
                self.procs.append(subprocess.Popen(cmd, env=rank_env, stdout=fh, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.proc = self.procs[0]  # rank 0: its exit status and log explain a missing result

    def result_file(self, engine: str, mode: str) -> Path:
        return self.logs / f"{engine}.{mode}.json"

    def run(self, timeout: float, report: Callable[[str, str, dict], None]) -> dict[str, dict[str, dict]]:
        """Lets the process go; returns {engine: {mode: result}}, calling `report` as each one arrives."""
        say(f"{', '.join(self.engines)}: checkpointing {', '.join(self.modes)} ...")
        self.go_file.touch()
        results: dict[str, dict[str, dict]] = {e: {} for e in self.engines}
        runs = [(e, m) for e in self.engines for m in self.modes]
        start = time.perf_counter()
        timed_out = False
        while True:
            done = all(proc.poll() is not None for proc in self.procs)
            for engine, mode in runs:
                if mode not in results[engine] and self.result_file(engine, mode).exists():
                    # written whole (rename)
                    results[engine][mode] = json.loads(self.result_file(engine, mode).read_text())
                    report(engine, mode, results[engine][mode])
            if done:
                break
            if time.perf_counter() - start > timeout:
                timed_out = True
                self.kill()
                break
            time.sleep(0.2)
        wall = time.perf_counter() - start
        for engine, mode in runs:
            if mode not in results[engine]:
                why = (f"timed out after {timeout:.0f}s" if timed_out
                       else f"exit {self.proc.returncode} without a result: {tail(self.log)}")
                results[engine][mode] = {"ok": False, "reason": f"{why} (log: {self.log})"}
                report(engine, mode, results[engine][mode])
            results[engine][mode]["process_wall_s"] = wall
        self.go_file.unlink(missing_ok=True)
        return results

    def kill(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def wait_for_go(go_file: str | None, poll_s: float = 0.05) -> None:
    """In the worker: returns once the parent has created `go_file` (at once without one)."""
    if not go_file:
        return
    path = Path(go_file)
    while not path.exists():
        time.sleep(poll_s)


def write_result(path: Path, result: dict) -> None:
    """In the worker: the result JSON, renamed into place so the parent never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def tail(log: Path, lines: int = 3) -> str:
    """The last non-empty lines of a log, for a failure's reason."""
    try:
        text = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return " / ".join(text[-lines:])[-300:] or "no output"
