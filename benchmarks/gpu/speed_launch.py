"""Starting the speed check's engine processes: one fresh process per engine, a world of one.

Process start and imports (torch, transformers, the engine: seconds each) are no part of what is
measured, so the next engine's process is started while the current one runs: it imports, then
waits for its "go" file before touching the device. Its timeout runs from the go. On a timeout
the process's whole session is killed (an engine may have started helpers).
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
    """One engine's worker process, from its start (imports) through go to its results."""

    def __init__(self, engine: str, modes: list[str], env: dict, settings_file: Path, logs: Path) -> None:
        self.engine, self.modes, self.logs = engine, modes, logs
        tag = "" if len(modes) > 1 else "." + modes[0]
        self.go_file = logs / f"{engine}{tag}.go"
        self.log = logs / f"{engine}{tag}.log"
        for path in [self.go_file, *(self.result_file(m) for m in modes)]:
            path.unlink(missing_ok=True)
        with socket.socket() as s:  # a free port for this world's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, str(HERE / "speed.py"), "--worker", engine, "--settings", str(settings_file),
               "--modes", ",".join(modes), "--result-dir", str(logs), "--go-file", str(self.go_file)]
        with open(self.log, "w") as fh:
            # A session of its own, so a timeout can end the whole process group.
            self.proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def result_file(self, mode: str) -> Path:
        return self.logs / f"{self.engine}.{mode}.json"

    def run(self, timeout: float, report: Callable[[str, dict], None]) -> dict[str, dict]:
        """Lets the process go; returns {mode: result}, calling `report` as each one arrives."""
        say(f"{self.engine}: checkpointing {', '.join(self.modes)} ...")
        self.go_file.touch()
        results: dict[str, dict] = {}
        start = time.perf_counter()
        timed_out = False
        while True:
            done = self.proc.poll() is not None
            for mode in self.modes:
                if mode not in results and self.result_file(mode).exists():
                    results[mode] = json.loads(self.result_file(mode).read_text())  # written whole (rename)
                    report(mode, results[mode])
            if done:
                break
            if time.perf_counter() - start > timeout:
                timed_out = True
                self.kill()
                break
            time.sleep(0.2)
        wall = time.perf_counter() - start
        for mode in self.modes:
            if mode not in results:
                why = (f"timed out after {timeout:.0f}s" if timed_out
                       else f"exit {self.proc.returncode} without a result: {tail(self.log)}")
                results[mode] = {"ok": False, "reason": f"{why} (log: {self.log})"}
                report(mode, results[mode])
            results[mode]["process_wall_s"] = wall
        self.go_file.unlink(missing_ok=True)
        return results

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


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
