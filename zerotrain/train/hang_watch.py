"""HangWatch: a job whose ranks stop meeting ends with an error naming them, not a silent wait.

Every rank notes where it is (step and phase: forward, backward, optimizer step) as it goes, in
memory; a thread of its own publishes that and a heartbeat in the job's TCP store once a second,
so the training step itself never waits on the store. A thread on every
rank checks: when its rank has not moved for `training.hang_timeout` seconds, it raises the alarm in
the store. Each rank that can still run then prints its Python stack (every thread); the rank that
raised it names the ranks that did not arrive (behind the furthest step and phase, or not running
at all: no heartbeat, e.g. SIGSTOP) and every rank leaves with HANG_EXIT_CODE, so the launcher
stops the job (a stopped rank is continued with SIGCONT after its SIGTERM, so it acts on it).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta

HANG_EXIT_CODE = 124  # as `timeout` exits
PHASES = ("start", "forward", "backward", "optimizer_step")
_PREFIX = f"zerotrain/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # a restarted job starts clean
_BEAT_S = 1.0
_STALE_S = 5.0  # a heartbeat this old: the rank's process is not running


class HangWatch:
    """One per rank; `at(step, phase)` as training moves, `close()` at the end."""

    def __init__(self, timeout_s: float, rank: int, world: int) -> None:
        self.timeout_s, self.rank, self.world = timeout_s, rank, world
        self.enabled = timeout_s > 0 and world > 1 and "MASTER_ADDR" in os.environ
        self._where = (0, 0)
        self._moved = time.monotonic()
        self._closed = threading.Event()
        if not self.enabled:
            return
        import torch.distributed as dist

        # A client of its own: the main thread may be blocked inside the process group.
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                   is_master=False, timeout=timedelta(seconds=60))
        threading.Thread(target=self._watch, name="zerotrain-hang-watch", daemon=True).start()

    def at(self, step: int, phase: str) -> None:
        """Where this rank is now: `phase` of `step`."""
        self._where = (step, PHASES.index(phase))
        self._moved = time.monotonic()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(_BEAT_S):
            try:
                step, phase = self._where
                self.store.set(f"{_PREFIX}at/{self.rank}", f"{step} {phase}")
                self.store.set(f"{_PREFIX}beat/{self.rank}", repr(time.time()))
                if self.store.check([f"{_PREFIX}alarm"]):
                    self._stop(None)
                if time.monotonic() - self._moved > self.timeout_s:
                    self.store.set(f"{_PREFIX}alarm", str(self.rank))
                    self._stop(self._culprits())
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    def _culprits(self) -> str:
        where, stopped = {}, []
        now = time.time()
        for r in range(self.world):
            at = self.store.get(f"{_PREFIX}at/{r}").decode().split() if self.store.check([f"{_PREFIX}at/{r}"]) else ["0", "0"]
            where[r] = (int(at[0]), int(at[1]))
            beat = f"{_PREFIX}beat/{r}"
            if r != self.rank and (not self.store.check([beat]) or now - float(self.store.get(beat)) > _STALE_S):
                stopped.append(r)
        furthest = max(where.values())
        behind = [r for r, w in where.items() if w < furthest]

        def place(w: tuple[int, int]) -> str:
            return f"step {w[0] + 1} {PHASES[w[1]]}" if w[1] else f"the start of step {w[0] + 1}"

        parts = []
        if stopped:
            parts.append(f"rank(s) {', '.join(map(str, stopped))} not running (no heartbeat for {_STALE_S:g} s: "
                         "stopped, or frozen in native code)")
        if behind:
            parts.append("rank(s) " + ", ".join(f"{r} (at {place(where[r])})" for r in behind)
                         + f" did not arrive at {place(furthest)}")
        return "; ".join(parts) or f"every rank is at {place(furthest)}: see the stacks for the collective they wait in"

    def _stop(self, culprits: str | None) -> None:
        if culprits is not None:
            print(f"zerotrain train: no progress for {self.timeout_s:g} s (training.hang_timeout): {culprits}. "
                  "Every running rank's stack follows; the job stops.", file=sys.stderr, flush=True)
        print(f"--- rank {self.rank} stack ---", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        time.sleep(2 * _BEAT_S)  # let the other ranks see the alarm and dump theirs
        os._exit(HANG_EXIT_CODE)
