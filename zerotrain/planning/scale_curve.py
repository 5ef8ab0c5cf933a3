"""`zerotrain plan --scale 8,64,512,4096`: the step-time model run over GPU counts, per stage.

At each count the global batch stays the plan's (strong scaling, what a fixed recipe does; past
one sample per GPU it grows to the GPU count, and the table says so): each GPU's share shrinks, so compute per GPU falls while each rank's communication per step does not
(stages 0-2 move 2x the gradients' bytes per rank at any count, stage 3 up to 3x), and from some
count on communication stops hiding behind compute. That count is marked: the first where the
step waits on communication for 10% or more of its time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from zerotrain.planning.ladder import Rung
from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung
from zerotrain.planning.step_time import StepTime, predict_step

EXPOSED_MARK = 0.10
"""Exposed-communication share from which a count is marked "communication shows"."""


@dataclass
class ScalePoint:
    gpus: int
    step: StepTime | None
    fits: bool
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "fits": self.fits, "note": self.note,
                "tokens_per_s_per_gpu": self.step.tokens_per_s_per_gpu if self.step else None,
                "tokens_per_s": self.step.tokens_per_s_per_gpu * self.gpus if self.step else None,
                "predicted": self.step.as_dict() if self.step else None}


@dataclass
class ScaleCurve:
    """One rung over the GPU counts."""

    rung: Rung
    points: list[ScalePoint] = field(default_factory=list)

    @property
    def comm_shows_from(self) -> int | None:
        """The first GPU count whose step waits on communication for EXPOSED_MARK or more."""
        return next((p.gpus for p in self.points if p.step and p.step.exposed_share >= EXPOSED_MARK), None)

    def as_dict(self) -> dict[str, Any]:
        return {"rung": self.rung.name, "stage": self.rung.stage, "comm_shows_from": self.comm_shows_from,
                "points": [p.as_dict() for p in self.points]}


def scale_curves(model: nn.Module, plan, counts: list[int], base_config: dict | None = None) -> list[ScaleCurve]:
    """Stages 0-3 (the plan's checkpointing, no offload; and the plan's own rung if it offloads)
    at each of `counts` GPUs, at the plan's global batch and sequence length."""
    from zerotrain.planning.model_flops import model_flops

    hw0, work = plan.hardware, plan.workload
    assert hw0 is not None and work is not None and plan.rates is not None
    ckpt = plan.choice.rung.gradient_checkpointing if plan.choice else False
    rungs = [Rung(stage, gradient_checkpointing=ckpt) for stage in range(4)]
    if plan.choice and plan.choice.rung not in rungs:
        rungs.append(plan.choice.rung)
    largest_mb = plan.choice.micro_batch if plan.choice else 1
    flops = model_flops(model, work.seq_len)
    curves = []
    for rung in rungs:
        curve = ScaleCurve(rung)
        for gpus in counts:
            per_node = min(gpus, hw0.gpus_per_node)
            if gpus % per_node:
                curve.points.append(ScalePoint(gpus, None, False, f"not whole nodes of {per_node}"))
                continue
            hw = Hardware(per_node, gpus // per_node, hw0.gpu_memory, hw0.cpu_memory, hw0.nvme_path)
            per_gpu = max(1, plan.global_batch // gpus)
            if gpus * per_gpu != plan.global_batch and plan.global_batch > gpus:
                curve.points.append(ScalePoint(gpus, None, False, f"batch {plan.global_batch} does not split"))
                continue
            note = f"batch {gpus} (1 per GPU)" if plan.global_batch < gpus else ""
            mb = max(m for m in range(1, min(largest_mb, per_gpu) + 1) if per_gpu % m == 0)
            workload = Workload(work.seq_len, mb, work.dtype, work.attention)
            fits = estimate_rung(model, rung, workload, hw, base_config).fits
            step = predict_step(model, rung, workload, hw, plan.rates, per_gpu // mb, base_config, flops)
            curve.points.append(ScalePoint(gpus, step, fits, note or ("" if fits else "does not fit")))
        curves.append(curve)
    return curves


def format_scale(curves: list[ScaleCurve]) -> str:
    """Tokens/s per GPU (and in all) per count and rung; "!" where communication shows (>= 10%)."""
    counts = [p.gpus for p in curves[0].points] if curves else []
    lines = [f"Scaling at the same global batch: tokens/s per GPU (in all), exposed communication share; "
             f"! = the step waits on communication {EXPOSED_MARK:.0%} or more; x = does not fit"]
    lines.append(f"{'GPUs':>7}" + "".join(f"{c.rung.name[:30]:>32}" for c in curves))
    for i, gpus in enumerate(counts):
        cells = []
        for c in curves:
            p = c.points[i]
            if p.step is None:
                cells.append(f"{p.note[:30]:>32}")
                continue
            mark = "!" if p.step.exposed_share >= EXPOSED_MARK else " "
            fit = " " if p.fits else "x"
            total = p.step.tokens_per_s_per_gpu * gpus
            cells.append(f"{p.step.tokens_per_s_per_gpu:>9,.0f} ({_short(total):>7}) {p.step.exposed_share:>4.0%}{mark}{fit}")
        notes = sorted({c.points[i].note for c in curves if c.points[i].step is not None and c.points[i].note
                        and c.points[i].note != "does not fit"})
        row = f"{gpus:>7}" + "".join(f"{cell:>32}" for cell in cells) + (f"  {'; '.join(notes)}" if notes else "")
        lines.append(row.rstrip())
    for c in curves:
        shows = c.comm_shows_from
        lines.append(f"{c.rung.name}: " + (f"communication shows from {shows} GPUs" if shows
                                            else "communication hides behind compute at every count"))
    return "\n".join(lines) + "\n"


def _short(tokens: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:.1f}{suffix}"
    return f"{tokens:.0f}"


def plot_scale(curves: list[ScaleCurve], path: str) -> None:
    """Two panels, tokens/s per GPU and in all against GPUs (log axes); a ring where communication shows."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2))
    per_gpu, total = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for c in curves:
        pts = [p for p in c.points if p.step is not None]
        xs = [p.gpus for p in pts]
        ys = [p.step.tokens_per_s_per_gpu for p in pts]
        line, = per_gpu.plot(xs, ys, marker="o", label=c.rung.name)
        total.plot(xs, [y * x for x, y in zip(xs, ys)], marker="o", color=line.get_color())
        shows = [(p.gpus, p.step.tokens_per_s_per_gpu) for p in pts if p.step.exposed_share >= EXPOSED_MARK]
        if shows:
            per_gpu.scatter(*zip(*shows), s=140, facecolors="none", edgecolors=line.get_color())
    for ax, title in ((per_gpu, "tokens/s per GPU (ring: communication >= 10%)"), (total, "tokens/s in all")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    total.set_yscale("log")
    per_gpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
