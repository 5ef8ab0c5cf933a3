"""The search for the largest size one engine trains in one mode: which size to try next.

A search starts at a given size (the engine's own prediction) and moves until a size that
trains sits next to one that does not. Failures that mark that boundary: host memory exceeded,
CUDA OOM, timeout, or a refusal. Any other error ends the search (it says nothing about size);
so does the wall-clock budget (size_schedule.py).

Steps are one size, except where a measurement says more (GPU runs only, `extrapolate=True`):
- after a success, the host memory of bigger sizes is extrapolated from the measured peaks
  (proportional to parameters from one success, a line through the two largest from two): the
  search jumps to the largest size whose extrapolation fits the limit, and a size whose
  extrapolation is over the limit by more than REFUSE_MARGIN is refused without running (it
  would fail after a minute of the budget);
- after a first failure with no success yet, it drops to the conservative `safe` size (DeepSpeed's
  own estimator, which allows 1.5x its model states) rather than one size down: one success there
  tells, by extrapolation, where the boundary is.
On the GPU a trial's memory is almost all model states, so the extrapolation is close (slightly
high, by the share of the process's fixed memory). At dry mode's ~1M-parameter sizes the fixed
part is most of the memory, so a dry run steps one size at a time and refuses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from size_ladder import Size

BOUNDARY = ("host memory", "CUDA OOM", "timeout", "refused")
REFUSE_MARGIN = 0.03


@dataclass
class Search:
    """One engine in one mode: its trials and where it stands."""

    mode: str
    engine: str
    sizes: list[Size]
    start: int  # the size index (1-based) to try first
    start_note: str = ""  # where `start` comes from
    safe: int | None = None  # a conservative size to drop to after a first failure
    host_limit_bytes: int | None = None  # for extrapolation; None: one size at a time, no refusals
    trials: list[dict[str, Any]] = field(default_factory=list)
    done: str | None = None  # why it stopped: "boundary found", "ladder top reached", ...

    def ok(self) -> list[int]:
        return [t["index"] for t in self.trials if t["status"] == "ok"]

    def failed(self) -> list[int]:
        return [t["index"] for t in self.trials if t["status"] != "ok" and t["reason"] in BOUNDARY]

    def largest_ok(self) -> int | None:
        return max(self.ok(), default=None)

    def first_failing(self) -> int | None:
        above = [i for i in self.failed() if i > (self.largest_ok() or 0)]
        return min(above, default=None)

    def extrapolated_host(self, size: Size) -> tuple[float, str] | None:
        """(bytes, how) the host peak of `size` would be, from this search's successes; None without one."""
        ok = sorted((t for t in self.trials if t["status"] == "ok" and t.get("host_peak_bytes")),
                    key=lambda t: t["params"])
        if not ok:
            return None
        a = ok[-1]
        b = next((t for t in reversed(ok[:-1]) if t["params"] < a["params"]), None)
        if b is not None:
            slope = (a["host_peak_bytes"] - b["host_peak_bytes"]) / (a["params"] - b["params"])
            if slope > 0:
                return (a["host_peak_bytes"] + slope * (size.params - a["params"]),
                        f"a line through {b['size']}'s and {a['size']}'s measured peaks")
        return a["host_peak_bytes"] * size.params / a["params"], f"{a['size']}'s measured peak, scaled by parameters"

    def refusal(self, size: Size) -> str | None:
        """Why `size` need not run: its extrapolated host peak is over the limit (None: run it)."""
        if self.host_limit_bytes is None:
            return None
        guess = self.extrapolated_host(size)
        if guess is None or guess[0] <= self.host_limit_bytes * (1 + REFUSE_MARGIN):
            return None
        return (f"extrapolated host peak {guess[0] / 2**30:.2f} GiB ({guess[1]}) > limit "
                f"{self.host_limit_bytes / 2**30:.2f} GiB + {REFUSE_MARGIN:.0%}")

    def next_index(self) -> int | None:
        """The size to try next, or None (and `done` set) when the search is over."""
        if self.done:
            return None
        if not self.trials:
            return max(1, min(self.start, len(self.sizes)))
        last = self.trials[-1]
        if last["status"] != "ok" and last["reason"] not in BOUNDARY:
            self.done = f"stopped: {last['reason']} at {last['size']}"
            return None
        ok, bad = self.largest_ok(), self.first_failing()
        if ok is not None and bad is not None and bad == ok + 1:
            self.done = "boundary found"
            return None
        if ok is not None:
            top = (bad - 1) if bad is not None else len(self.sizes)
            if ok >= top:
                self.done = "ladder top reached"
                return None
            return self._jump_up(ok, top)
        low = min(self.failed())
        if low <= 1:
            self.done = "failed at the smallest size"
            return None
        if self.host_limit_bytes is not None and self.safe and self.safe < low - 1 and len(self.failed()) == 1:
            return self.safe
        return low - 1

    def _jump_up(self, ok: int, top: int) -> int:
        """The largest size in (ok, top] whose extrapolated host peak fits the limit; ok + 1 when none does."""
        if self.host_limit_bytes is None:
            return ok + 1
        best = ok + 1
        for index in range(ok + 1, top + 1):
            guess = self.extrapolated_host(self.sizes[index - 1])
            if guess is not None and guess[0] <= self.host_limit_bytes:
                best = index
        return best
