"""Rank 0's progress bar: step, loss, lr, tokens/s and ETA, with metrics lines printed above it.

Other ranks get a disabled bar. Without a terminal (a detached run writing train.log,
a pipe, captured output) there is no bar at all, not even a final one: the metrics
lines still go to the output, each whole on one line.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainingProgress:
    """A context manager around rich's Progress, tolerant of being disabled."""

    def __init__(self, rank0: bool, bar: bool, total_steps: int, done_steps: int) -> None:
        self._console = self.console()
        # logging.progress_bar asks for a bar in a terminal; rich would print its last frame into a file.
        enabled = rank0 and bar and self._console.is_terminal
        self.enabled = enabled
        self._printing = rank0
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            console=self._console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=done_steps, loss="-", lr="-", tps="-")

    @staticmethod
    def console() -> Console:
        # soft_wrap: long metrics lines stay whole in log files instead of folding at 80 columns.
        return Console(soft_wrap=True)

    def __enter__(self) -> "TrainingProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def advance(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        self.progress.update(
            self.task, completed=step,
            loss="-" if math.isnan(loss) else f"{loss:.4f}", lr=f"{lr:.2e}",
            tps="-" if math.isnan(tokens_per_s) else f"{tokens_per_s:,.0f}",
        )

    def note(self, line: str) -> None:
        """Prints a line above the bar (rank 0 only; others never call with enabled output)."""
        if self._printing:
            self.progress.console.print(line, markup=False, highlight=False)
