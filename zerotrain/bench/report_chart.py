"""`zerotrain bench report`'s picture: one bar per job, coloured by verdict, and the threshold line.

Drawn on a bare matplotlib Figure with the Agg canvas: no pyplot state, no display
needed, so it works over ssh and in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from zerotrain.bench.throughput import UNITS, format_rate

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class ChartRow(Protocol):
    """What a bar needs of a report row (report.py's JobResult is one); the chart knows no more."""

    job: str
    nodes: list[str]
    throughput: float | None
    verdict: str

VERDICT_COLOURS = {"pass": "#2e7d32", "fail": "#f9a825", "timeout": "#6a1b9a", "crash": "#c62828"}
THRESHOLD_LABEL = "threshold"
THRESHOLD_GID = "threshold"
"""The threshold line's gid: how a test (or a script) finds it among the axes' lines."""


def build_chart(results: Sequence[ChartRow], threshold: float | None, metric: str) -> Figure:
    """The bar chart as a Figure: bars of the throughput found (none: an empty bar with the verdict over it)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    width = min(40.0, max(7.0, 0.6 * len(results) + 3.0))  # readable labels up to a few dozen jobs
    figure = Figure(figsize=(width, 4.8), layout="constrained")
    axes = figure.add_subplot()
    positions = range(len(results))
    heights = [r.throughput or 0.0 for r in results]
    bars = axes.bar(positions, heights, color=[VERDICT_COLOURS[r.verdict] for r in results], edgecolor="black",
                    linewidth=0.5)
    predicted = [getattr(r, "predicted", None) for r in results]
    top = max([*heights, threshold or 0.0, *(p or 0.0 for p in predicted), 1e-9])
    for bar, result in zip(bars, results):
        if result.verdict != "pass":
            axes.annotate(result.verdict, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    if threshold is not None:
        axes.axhline(threshold, color="black", linestyle="--", linewidth=1.2, gid=THRESHOLD_GID,
                     label=f"{THRESHOLD_LABEL} {format_rate(threshold)}")
    if any(p is not None for p in predicted):  # each job's own prediction: a tick over its bar
        axes.plot(list(positions), [float("nan") if p is None else p for p in predicted], linestyle="none",
                  marker="_", markersize=18, markeredgewidth=2, color="black", label="predicted")
    axes.set_ylim(0, top * 1.15)
    axes.set_xticks(list(positions), [_tick_label(r) for r in results], rotation=45 if len(results) > 6 else 0,
                    ha="right" if len(results) > 6 else "center", fontsize=8)
    axes.set_xlabel("job (hostfile)")
    axes.set_ylabel(f"throughput ({UNITS[metric]})")
    passed = sum(r.verdict == "pass" for r in results)
    axes.set_title(f"zerotrain bench: {passed} of {len(results)} jobs passed")
    present = [v for v in VERDICT_COLOURS if any(r.verdict == v for r in results)]
    handles = [Patch(color=VERDICT_COLOURS[v], label=v) for v in present]
    # Outside the axes, on the right: inside, it would hide the top of a bar.
    axes.legend(handles=[*handles, *axes.get_lines()], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure


def _tick_label(result: ChartRow) -> str:
    """The job's name, with its nodes below when they fit (small jobs, where a node name says the most)."""
    nodes = " ".join(result.nodes)
    return f"{result.job}\n{nodes}" if len(nodes) <= 24 else result.job


def save_chart(results: Sequence[ChartRow], threshold: float | None, metric: str, path: Path) -> Path:
    """Writes the chart to `path` as a PNG (its folder is made if needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = build_chart(results, threshold, metric)
    FigureCanvasAgg(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path
