"""The steps since the last metrics line, and that line as rank 0 prints it."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist


class StepWindow:
    """Losses of the steps since the last metrics line."""

    def __init__(self, first_step: int, started: float) -> None:
        self.first_step, self.started = first_step, started
        self.losses: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        """Records one step's mean loss (a tensor: read only when the line is made, no sync per step)."""
        self.losses.append(loss)

    def mean_loss(self, world: int) -> float:
        """The window's mean loss over every rank (a collective: every rank calls it)."""
        mean = torch.stack(self.losses).mean() if self.losses else torch.zeros(())
        if world > 1:
            dist.all_reduce(mean)
            mean = mean / world
        return float(mean)

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Tokens per second over the window so far, every rank's together."""
        seconds = time.perf_counter() - self.started
        return len(self.losses) * tokens_per_step / seconds if seconds > 0 else math.nan


def as_float(value: Any) -> float:
    """`value` as a float; NaN for None (a figure the engine has not produced yet)."""
    return float(value) if value is not None else math.nan


def describe_step(row: dict, memory: str, fp16: bool) -> str:
    """The metrics line of `row` (a metrics.csv row), with the memory figures `memory` already worded."""
    parts = [f"step {row['step']}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.3g}",
             f"grad norm {row['grad_norm']:.3g}", f"{row['tokens_per_s']:,.0f} tok/s total",
             f"{row['samples_per_s']:.1f} samples/s total"]
    if fp16:
        parts.append(f"scale {row['loss_scale']:g} skipped {row['skipped_steps']}")
    if not math.isnan(row["tflops"]):
        parts.append(f"{row['tflops']:.2f} TFLOP/s per rank" + (f" MFU {row['mfu']:.1%}" if not math.isnan(row["mfu"]) else ""))
    parts.append(f"mem {memory}")
    return " | ".join(parts)
