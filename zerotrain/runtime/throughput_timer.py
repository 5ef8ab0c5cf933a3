"""ThroughputTimer: DeepSpeed's `engine.tput_timer`, for the scripts that call it.

DeepSpeed-Chat and the training scripts derived from it call `engine.tput_timer.update_epoch_count()`
after every epoch; some read `avg_samples_per_sec()`. This one counts epochs and reports samples per
second over the optimizer steps taken so far (from the first step's end, so set-up is not counted).
"""

from __future__ import annotations

import time
from typing import Callable


class ThroughputTimer:
    """Epochs counted by the script; samples per second from the engine's step counters."""

    def __init__(self, samples_done: Callable[[], int]) -> None:
        self._samples_done = samples_done
        self.epoch_count = 0
        self._first: tuple[float, int] | None = None  # (time, samples) when the first step ended

    def update_epoch_count(self) -> None:
        """The script finished an epoch."""
        self.epoch_count += 1

    def step_done(self) -> None:
        """Called by the engine after each optimizer step."""
        if self._first is None:
            self._first = (time.perf_counter(), self._samples_done())

    def avg_samples_per_sec(self) -> float:
        """Samples per second since the first step ended (0.0 before a second step)."""
        if self._first is None:
            return 0.0
        seconds = time.perf_counter() - self._first[0]
        samples = self._samples_done() - self._first[1]
        return samples / seconds if seconds > 0 and samples > 0 else 0.0
