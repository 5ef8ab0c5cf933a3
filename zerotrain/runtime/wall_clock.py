"""WallClockBreakdown: time spent in forward, backward and step (`wall_clock_breakdown`)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch


class WallClockBreakdown:
    """Accumulates milliseconds per phase between reports; does nothing when disabled."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        # GPU work is asynchronous: without a sync the time would be the launch time.
        self._sync = enabled and device.type == "cuda"
        self._ms: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self._sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self._ms[phase] += (time.perf_counter() - start) * 1000.0

    def report(self) -> str:
        """'forward 12.3ms | backward 30.1ms | step 4.0ms' since the last report; resets."""
        text = " | ".join(f"{phase} {ms:.1f}ms" for phase, ms in self._ms.items())
        self._ms.clear()
        return text
