"""The search for the longest sequence one shape trains in one mode: doubling, then bisection.

From a start length the search doubles while trials train; the first that runs out of memory
("CUDA OOM" or "host memory") bounds it, and bisection between the longest that trained and the
shortest that did not narrows the boundary to `resolution` (1/16 of the longest that trained, at
least one grain: finer than the 10% the planner is held to). A start that fails halves instead.

Time, not memory, is what a 10-minute loan runs out of first at long lengths (attention grows with
the square of the length). Before each trial its wall time is predicted from the trials that
trained (this search's, else its `reference`'s; step time a*L + b*L^2 through the two longest, or scaled by L^2 from one; plus their
start-up time); a length predicted past the time left is not run, and the search ends there
with "time" as its reason: the longest trained is then a lower bound, not the boundary. A trial
killed by its timeout ends the search the same way. Any other failure ("error") ends it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEMORY = ("CUDA OOM", "host memory")


@dataclass
class LengthSearch:
    """One shape in one mode: its trials (in order) and where it stands."""

    shape: str
    mode: str
    start: int
    grain: int  # lengths are multiples of this
    cap: int  # the longest length tried
    steps: int = 3
    trials: list[dict[str, Any]] = field(default_factory=list)
    done: str | None = None  # why it stopped
    not_tried: list[dict[str, Any]] = field(default_factory=list)  # lengths skipped for lack of time
    # Trials of a similar search (ALST's: plain's at the same shape) to predict time from before this has its own.
    reference: list[dict[str, Any]] = field(default_factory=list)

    def ok(self) -> list[int]:
        return [t["seq"] for t in self.trials if t["status"] == "ok"]

    def longest_ok(self) -> int | None:
        return max(self.ok(), default=None)

    def shortest_memory_failure(self) -> int | None:
        above = [t["seq"] for t in self.trials
                 if t["status"] != "ok" and t.get("reason") in MEMORY and t["seq"] > (self.longest_ok() or 0)]
        return min(above, default=None)

    def bounded_by_memory(self) -> bool:
        """Whether the longest trained sits within `resolution` of a length that ran out of memory."""
        ok, bad = self.longest_ok(), self.shortest_memory_failure()
        return ok is not None and bad is not None and bad - ok <= self.resolution(ok)

    def resolution(self, ok: int) -> int:
        return max(self.grain, self._round(ok // 16))

    def _round(self, seq: int) -> int:
        return seq // self.grain * self.grain

    def next_length(self) -> int | None:
        """The length to try next, or None (and `done` set) when the search is over."""
        if self.done:
            return None
        if not self.trials:
            return max(self.grain, min(self._round(self.start), self.cap))
        last = self.trials[-1]
        if last["status"] != "ok" and last.get("reason") not in MEMORY:
            self.done = "time" if last.get("reason") in ("timeout", "budget") else f"stopped: {last.get('reason')}"
            return None
        ok, bad = self.longest_ok(), self.shortest_memory_failure()
        if ok is None:
            low = min(t["seq"] for t in self.trials)
            if low <= self.grain:
                self.done = "fails at the shortest length"
                return None
            return max(self.grain, self._round(low // 2))
        if bad is None:
            if ok >= self.cap:
                self.done = "cap reached"
                return None
            return min(self.cap, ok * 2)
        if bad - ok <= self.resolution(ok):
            self.done = "boundary found"
            return None
        mid = self._round((ok + bad) // 2)
        return mid if ok < mid < bad else None

    def predicted_wall_s(self, seq: int) -> float | None:
        """A trial's wall time at `seq` from the trials that trained (see the module docstring); None without one."""
        ok = sorted((t for t in self.trials if t["status"] == "ok" and t.get("median_step_s")), key=lambda t: t["seq"])
        if not ok:
            ok = sorted((t for t in self.reference if t["status"] == "ok" and t.get("median_step_s")),
                        key=lambda t: t["seq"])
        if not ok:
            return None
        a = ok[-1]
        startup = max(0.0, a["wall_s"] - sum(a["step_s"]))
        step = a["median_step_s"] * (seq / a["seq"]) ** 2
        if len(ok) > 1 and ok[-2]["seq"] < a["seq"]:
            b = ok[-2]
            # t = p*L + q*L^2 through both points; a negative term (noise) falls back to the L^2 scaling
            la, lb, ta, tb = a["seq"], b["seq"], a["median_step_s"], b["median_step_s"]
            q = (ta / la - tb / lb) / (la - lb)
            p = ta / la - q * la
            if p >= 0 and q >= 0:
                step = p * seq + q * seq * seq
        return startup + self.steps * step

    def fits_in(self, seq: int, seconds_left: float) -> bool:
        """False (and the length noted as not tried) when its predicted wall time is over `seconds_left`."""
        guess = self.predicted_wall_s(seq)
        if guess is None or guess <= seconds_left:
            return True
        self.not_tried.append({"seq": seq, "predicted_wall_s": round(guess, 1), "seconds_left": round(seconds_left, 1)})
        self.done = "time"
        return False
