"""Which trial runs next, within the wall-clock budget: the searches in order, then the comparisons.

Searches run one after another (zerotrain's modes, then DeepSpeed's). The budget is shared: a
trial starts only if, after it, each later search keeps time for one trial (a step down: no
size has trained yet) or two (a step up, which is optional), at this trial's expected time. A
trial never runs past the budget: its timeout is what is left of it.

After a mode's two searches, if no size trained under both engines, the engine that reached
further runs the other's largest size once more (a "comparison" trial), so tokens/s are compared
at one size.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from size_ladder import MODES, Size
from size_launch import Limits, run_trial
from size_search import Search
from size_watch import wait_for_memory

GIB = 2**30


def estimate_s(searches: list[Search], search: Search, size: Size, dry: bool) -> float:
    """A trial's expected wall time: this search's (else this engine's, else any) slowest trial so far,
    scaled by parameters on the GPU (offload's copies and the CPU optimizer step grow with them; a dry
    trial's time is mostly the start-up of its process)."""
    for pool in ([t for t in search.trials], [t for s in searches if s.engine == search.engine for t in s.trials],
                 [t for s in searches for t in s.trials]):
        ran = [t for t in pool if t["status"] != "refused"]
        if ran:
            return max(t["wall_s"] * (1.0 if dry else max(1.0, size.params / t["params"])) for t in ran)
    return 0.0


def cap_by_measured(search: Search, searches: list[Search]) -> None:
    """Offloading the parameters too only adds host memory (the GPU is not what runs out here), so a
    size the same engine could not train with the optimizer alone offloaded is not tried first."""
    if not MODES[search.mode][1]:
        return
    for other in searches:
        if other.engine != search.engine or MODES[other.mode][1] or not other.trials:
            continue
        bound = other.largest_ok() or ((other.first_failing() or 1) - 1)
        if bound and bound < search.start:
            search.start, search.start_note = bound, f"{search.start_note}, capped at {other.mode}'s measured largest"


class Schedule:
    """Runs the searches and comparisons of one size check (see the module docstring)."""

    def __init__(self, args, facts: dict, limits: Limits, plan: dict, sizes: list[Size], log_dir: Path,
                 t0: float, report: Callable[[dict], None]) -> None:
        self.args, self.facts, self.limits, self.plan, self.sizes = args, facts, limits, plan, sizes
        self.log_dir, self.t0, self.report = log_dir, t0, report
        self.min_trial_s = 4.0 if args.dry else 20.0
        self.available0 = facts["host_mem_available_bytes"]
        self.order = 0  # trials are numbered in the order they ran (comparisons come after their search)

    def _numbered(self, rec: dict[str, Any]) -> dict[str, Any]:
        self.order += 1
        rec["order"] = self.order
        return rec

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def run(self, searches: list[Search]) -> None:
        for n, search in enumerate(searches):
            cap_by_measured(search, searches)
            later = len(searches) - n - 1
            while (index := search.next_index()) is not None:
                if not self.step(searches, search, self.sizes[index - 1], later):
                    break
            print(f"[size] {search.mode} {search.engine}: largest {self._name(search.largest_ok())}, first failing "
                  f"{self._name(search.first_failing())} ({search.done})", flush=True)
            done_mode = [s for s in searches if s.mode == search.mode]
            if search is done_mode[-1] and len(done_mode) == 2:
                self.compare(searches, *done_mode, later)

    def step(self, searches: list[Search], search: Search, size: Size, later: int) -> bool:
        """Runs (or refuses) one trial of `search`; False when the budget stops the search."""
        ok = search.largest_ok()
        stepping_up = ok is not None and size.index > ok
        why = None if self.args.no_refuse else search.refusal(size)
        if why:
            search.trials.append(self._numbered({
                "mode": search.mode, "engine": search.engine, "size": size.name, "index": size.index,
                "params": size.params, "layers": size.layers, "status": "refused", "reason": "refused",
                "detail": why, "wall_s": 0.0}))
            print(f"[size] {search.mode} {search.engine} {size.name}: refused, {why}", flush=True)
            return True
        rec = self.trial(searches, search, size, later, 2 if stepping_up else 1)
        if rec is None:
            return False
        search.trials.append(rec)
        return True

    def trial(self, searches: list[Search], search: Search, size: Size, later: int, per_later: int,
              comparison: bool = False) -> dict[str, Any] | None:
        """One watched trial, if the budget allows it (keeping `per_later` trials' time for each later search)."""
        left, est = self.left(), estimate_s(searches, search, size, self.args.dry)
        reserve = per_later * later * est
        if left < self.min_trial_s or est > left - reserve:
            search.done = (f"budget: {size.name} not tried (~{est:.0f} s expected, {left:.0f} s left"
                           + (f", of which ~{reserve:.0f} s kept for the {later} searches after this" if reserve else "")
                           + ")")
            return None
        if not self.args.dry:
            # A killed trial's pinned pages take a moment to come back. Not in a dry run: its trials pin
            # nothing and take ~200 MiB, so there the wait would only be for other processes' memory.
            wait_for_memory(self.available0 - GIB)
        timeout = min(self.args.trial_timeout_s, left)
        args, facts = self.args, self.facts
        rec = run_trial(search, size, python=args.deepspeed_python if search.engine == "deepspeed" else sys.executable,
                        cuda=facts["cuda"], threads=facts["cores"] if facts["cuda"] else 1, seq=args.seq,
                        steps=args.steps, stage3_build=args.stage3_build, limits=self.limits, timeout_s=timeout,
                        log_dir=self.log_dir, budget_cut=timeout < args.trial_timeout_s)
        planned = self.plan[search.mode]["sizes"].get(size.name, {})
        rec["planner"] = {k: planned.get(k) for k in ("gpu_bytes", "host_bytes")}
        if comparison:
            rec["comparison"] = True
        self.report(self._numbered(rec))
        return rec

    def compare(self, searches: list[Search], first: Search, second: Search, later: int) -> None:
        """The engine that reached further trains the other's largest size, when no size trained under both."""
        a, b = first.largest_ok(), second.largest_ok()
        if a is None or b is None or set(first.ok()) & set(second.ok()):
            return
        runner, index = (first, b) if a > b else (second, a)
        done = runner.done
        rec = self.trial(searches, runner, self.sizes[index - 1], later, 1, comparison=True)
        if rec is None:
            runner.done = done  # a comparison the budget skipped does not change how the search ended
            return
        runner.trials.append(rec)

    def _name(self, index: int | None) -> str:
        return self.sizes[index - 1].name if index else "none"
