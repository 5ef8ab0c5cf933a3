"""A benchmark job's throughput, found in its folder (the layout of run_dir.py).

Where it looks, in this order (the first that gives the metric asked for wins):

1. ``metrics.csv`` of ``zerotrain train``: JOB/train/metrics.csv, else any metrics.csv
   under the job folder. The figure is the mean of the logged rows after the first
   (the first interval holds start-up: compilation, allocator warm-up, data loading);
   with one row, that row. Every later interval counts, so a node that stalls now and
   then pulls the figure down, as it would slow a real run.
2. Lines of JOB/log.txt, for jobs that write no metrics.csv:
   - ``Throughput: 72.7 samples/sec``: what the cluster bring-up guide's training
     scripts print once at the end (the last such line is used);
   - HF Trainer's end-of-training metrics, ``'train_samples_per_second': 40.5`` in its
     printed dict or ``train_samples_per_second = 40.5`` from ``log_metrics`` (last);
   - DeepSpeed's throughput timer, ``RunningAvgSamplesPerSec=74.0`` (the last one, a
     running average already), else the mean of its ``SamplesPerSec=`` values after the first;
   - ``zerotrain train``'s progress lines, ``step 10 | ... | 12,345 tok/s | 96.4 samples/s``
     (the mean after the first, as for metrics.csv).

Only HF's ``train_tokens_per_second`` and zerotrain's own figures give tokens/s; the
guide's and DeepSpeed's lines give samples/s.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from zerotrain.bench.run_dir import LOG_FILE, TRAIN_DIR

METRICS = ("samples_per_s", "tokens_per_s")
UNITS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s"}
METRICS_CSV = "metrics.csv"

# A number as these tools print it: 72.7058, 1e+03, or zerotrain's thousands separators (12,345).
_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"


@dataclass(frozen=True)
class Throughput:
    """One job's throughput and where it was read."""

    value: float
    metric: str
    """`samples_per_s` or `tokens_per_s`."""
    source: str
    """Where the figure comes from, e.g. `log.txt: DeepSpeed RunningAvgSamplesPerSec (last)`."""


def format_rate(value: float) -> str:
    """A throughput as people read it: 72.71, 142.5, 16,000."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def find_throughput(job_dir: Path, metric: str) -> tuple[Throughput | None, str]:
    """The job's `metric` and an empty string, or None and why none was found."""
    found = _search(job_dir, metric)
    if found is not None:
        return found, ""
    other = next(m for m in METRICS if m != metric)
    if _search(job_dir, other) is not None:
        return None, (f"no {metric} found; the job reports {other} only: use --metric {other}")
    log = job_dir / LOG_FILE
    places = "no metrics.csv, and " + ("no throughput line in log.txt" if log.is_file() else "no log.txt")
    return None, f"no throughput found: {places} (`Throughput:`, SamplesPerSec=, train_samples_per_second, tok/s)"


def _search(job_dir: Path, metric: str) -> Throughput | None:
    for path in metrics_csv_files(job_dir):
        found = from_metrics_csv(path, metric, label=path.relative_to(job_dir).as_posix())
        if found is not None:
            return found
    log = job_dir / LOG_FILE
    if log.is_file():
        return from_log_text(log.read_text(encoding="utf-8", errors="replace"), metric)
    return None


def metrics_csv_files(job_dir: Path) -> list[Path]:
    """JOB/train/metrics.csv first (a built-in workload's), then any other metrics.csv below the job folder."""
    preferred = job_dir / TRAIN_DIR / METRICS_CSV
    others = sorted(p for p in job_dir.rglob(METRICS_CSV) if p != preferred and p.is_file())
    return ([preferred] if preferred.is_file() else []) + others


def from_metrics_csv(path: Path, metric: str, label: str = METRICS_CSV) -> Throughput | None:
    """The mean of `metric` over the rows of a zerotrain metrics.csv after the first (None: no values)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            values = [v for row in csv.DictReader(file) if (v := _float(row.get(metric))) is not None]
    except OSError:
        return None
    return _mean_after_first(values, metric, f"{label}: mean of {{n}} logged steps after the first", label)


def from_log_text(text: str, metric: str) -> Throughput | None:
    """The job's `metric` from its log lines, by the patterns in this module's docstring (None: none match)."""
    for finder in _LOG_FINDERS:
        found = finder(text, metric)
        if found is not None:
            return found
    return None


def _guide_line(text: str, metric: str) -> Throughput | None:
    unit = "samples" if metric == "samples_per_s" else "tokens"
    values = _numbers(rf"Throughput:\s*{_NUMBER}\s*{unit}/s(?:ec)?\b", text)
    return Throughput(values[-1], metric, "log.txt: `Throughput:` line") if values else None


def _hf_trainer(text: str, metric: str) -> Throughput | None:
    key = "train_samples_per_second" if metric == "samples_per_s" else "train_tokens_per_second"
    values = _numbers(rf"\b{key}['\"]?\s*[:=]\s*{_NUMBER}", text)
    return Throughput(values[-1], metric, f"log.txt: HF Trainer {key}") if values else None


def _deepspeed_timer(text: str, metric: str) -> Throughput | None:
    if metric != "samples_per_s":
        return None
    running = _numbers(rf"RunningAvgSamplesPerSec={_NUMBER}", text)
    if running:
        return Throughput(running[-1], metric, "log.txt: DeepSpeed RunningAvgSamplesPerSec (last)")
    values = _numbers(rf"(?<!RunningAvg)SamplesPerSec={_NUMBER}", text)
    return _mean_after_first(values, metric, "log.txt: DeepSpeed SamplesPerSec=, mean of {n} after the first",
                             "log.txt: DeepSpeed SamplesPerSec=")


def _zerotrain_progress(text: str, metric: str) -> Throughput | None:
    # trainer.py's metrics line: "step 10 | loss ... | 12,345 tok/s | 96.4 samples/s | ..."
    unit = "samples/s" if metric == "samples_per_s" else "tok/s"
    values = _numbers(rf"\bstep \d+ \|.*?\|\s*{_NUMBER} {re.escape(unit)}(?![a-z])", text)
    return _mean_after_first(values, metric, "log.txt: zerotrain train progress lines, mean of {n} after the first",
                             "log.txt: zerotrain train progress line")


_LOG_FINDERS: tuple[Callable[[str, str], Throughput | None], ...] = (
    _guide_line, _hf_trainer, _deepspeed_timer, _zerotrain_progress,
)


def _numbers(pattern: str, text: str) -> list[float]:
    return [v for match in re.finditer(pattern, text) if (v := _float(match.group(1))) is not None]


def _float(cell: str | None) -> float | None:
    if cell is None:
        return None
    try:
        value = float(cell.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _mean_after_first(values: list[float], metric: str, many: str, one: str) -> Throughput | None:
    """The mean of `values` after the first (start-up) one; the only value when there is one."""
    if not values:
        return None
    if len(values) == 1:
        return Throughput(values[0], metric, one)
    return Throughput(fmean(values[1:]), metric, many.format(n=len(values) - 1))
