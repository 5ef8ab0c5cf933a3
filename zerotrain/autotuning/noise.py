"""Is the winner's lead real? Medians and spreads of repeated trials, which trials to repeat, the verdict.

A timing on a shared machine varies from run to run: one configuration measured 552 and 678
samples/s in two runs. So a lead counts only when the winner's spread (min-max over its repeats)
and every other trial's spread do not overlap; otherwise those trials are within noise, and the
verdict says so instead of naming a winner. Pure functions of {trial name: [measurements]}.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

NOISE_GUESS = 0.10
"""Until a trial is repeated its spread is unknown: one measurement is taken to mean +-10%."""
MAX_CONTENDERS = 3
"""Runners-up repeated beside the leader at most (the closest by median): bounds the extra trials."""
UNITS = {"throughput": "samples/s", "latency": "s/step", "flops": "FLOPS"}


@dataclass(frozen=True)
class Spread:
    """One trial's measurements of the metric."""

    name: str
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def overlaps(self, other: "Spread") -> bool:
        """The two min-max ranges share a value (a single run is a range of one point)."""
        return self.low <= other.high and other.low <= self.high

    def text(self) -> str:
        """"1201-1310 (+-4%)", or "1277 (1 run)"."""
        if len(self.values) < 2:
            return f"{fmt(self.low)} (1 run)"
        half = (self.high - self.low) / 2 / self.median * 100 if self.median else 0.0
        return f"{fmt(self.low)}-{fmt(self.high)} (+-{half:.0f}%)"


@dataclass(frozen=True)
class Verdict:
    """Which trial to use, and whether its lead is outside the noise."""

    winner: str | None
    """The best median (None when no trial ran)."""
    within_noise: tuple[str, ...]
    """The trials whose spreads overlap the winner's, winner first; empty when the lead is clear."""
    lead_pct: float | None
    """How far the winner's median is ahead of the runner-up's, in percent (None: no runner-up)."""
    measured: bool
    """The winner and runner-up were each run at least twice, so their spreads are measured."""
    text: str
    """One line for people."""


def fmt(value: float) -> str:
    """Four significant digits, as the result table shows values."""
    return f"{value:.4g}"


def better(metric: str, a: float, b: float) -> bool:
    """`a` beats `b` for `metric` (latency: lower is better; throughput and FLOPS: higher)."""
    return a < b if metric == "latency" else a > b


def ranked(samples: Mapping[str, Sequence[float]], metric: str) -> list[Spread]:
    """Trials with measurements, best median first; equal medians keep the given (trial) order."""
    spreads = [Spread(name, tuple(values)) for name, values in samples.items() if values]
    sign = 1 if metric == "latency" else -1
    return sorted(spreads, key=lambda s: sign * s.median)  # sorted is stable: ties stay in trial order


def lead_pct(metric: str, winner: Spread, other: Spread) -> float:
    """How much better the winner's median is, in percent of the other's (latency: how much shorter)."""
    if metric == "latency":
        return (other.median - winner.median) / other.median * 100 if other.median else 0.0
    return (winner.median - other.median) / other.median * 100 if other.median else float("inf")


def to_repeat(samples: Mapping[str, Sequence[float]], metric: str, limit: int) -> list[str]:
    """The trials to run once more: the leader and the runners-up it is not yet clearly ahead of.

    A runner-up is in contention while its band overlaps the leader's: the band is the min-max of
    the runs, or +-NOISE_GUESS around a single run. The first runner-up is always repeated once, so
    the verdict compares two measured spreads. Trials already run `limit` times are left out; an
    empty list means the lead is settled (or the limit reached).
    """
    order = ranked(samples, metric)
    if len(order) < 2:
        return []
    leader = order[0]
    contenders = [s for s in order[1:] if _band_overlap(leader, s)][:MAX_CONTENDERS]
    if len(order[1].values) < 2 and order[1] not in contenders:
        contenders.insert(0, order[1])
    if not contenders:
        return []
    return [s.name for s in (leader, *contenders) if len(s.values) < limit]


def _band_overlap(a: Spread, b: Spread) -> bool:
    def band(s: Spread) -> tuple[float, float]:
        if len(s.values) > 1:
            return s.low, s.high
        return s.low * (1 - NOISE_GUESS), s.high * (1 + NOISE_GUESS)

    (a_low, a_high), (b_low, b_high) = band(a), band(b)
    return a_low <= b_high and b_low <= a_high


def verdict(samples: Mapping[str, Sequence[float]], metric: str) -> Verdict:
    """The winner when its spread is clear of every other trial's, else the trials within noise of it."""
    unit = UNITS.get(metric, metric)
    order = ranked(samples, metric)
    if not order:
        return Verdict(None, (), None, False, "no trial ran: nothing to pick")
    top = order[0]
    if len(order) == 1:
        return Verdict(top.name, (), None, len(top.values) > 1,
                       f"winner {top.name}: median {fmt(top.median)} {unit} (the only trial that ran)")
    second = order[1]
    lead = lead_pct(metric, top, second)
    measured = len(top.values) > 1 and len(second.values) > 1
    tied = [s for s in order[1:] if top.overlaps(s)]
    if tied:
        names = [top.name, *(s.name for s in tied)]
        listed = ", ".join(names[:-1]) + f" and {names[-1]}"
        higher = "lower" if metric == "latency" else "higher"
        why = (f"its median is {higher} ({fmt(top.median)} vs {fmt(tied[0].median)} {unit}), by less than the noise"
               if top.median != tied[0].median else "it came first in the trial order (the plan's faster rung)")
        return Verdict(top.name, tuple(names), lead, measured,
                       f"{listed} are within noise (spreads overlap): pick either; "
                       f"{top.name} listed first because {why}")
    head = f"winner {top.name}: median {fmt(top.median)} {unit}, ahead of {second.name} by {lead:.0f}%"
    if not measured:
        return Verdict(top.name, (), lead, False,
                       f"{head} on a single run (spread not measured: it takes --repeats 2 or more, and time left "
                       "in --time-budget)")
    return Verdict(top.name, (), lead, True, f"{head} (outside both spreads)")
