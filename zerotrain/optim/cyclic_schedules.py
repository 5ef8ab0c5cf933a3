"""DeepSpeed's cyclic schedules: LRRangeTest (a growing lr to find the largest stable one) and OneCycle
(lr and momentum up, then down, then a decay), with DeepSpeed's formulas and parameter names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zerotrain.optim.schedule_base import StepSchedule, logger, per_group

class LRRangeTest(StepSchedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest usable one.

    lr = min_lr * (1 + step_rate * interval), interval = (i + 1) / step_size, floored when
    ``lr_range_test_staircase``, where i is ``last_batch_iteration``.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(lr_range_test_min_lr, len(self.optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply(self.min_lr)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


class OneCycle(StepSchedule):
    """1Cycle: lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then decays.

    During the cycle (``cycle_first_step_size`` up, ``cycle_second_step_size`` down) the lr is
    ``min + (max - min) * scale`` and, with ``cycle_momentum``, beta1 moves the opposite way,
    ``max_mom - (max_mom - min_mom) * scale``. After the cycle, with ``decay_step_size`` and a
    non-zero rate, ``lr = min_lr / (1 + decay_lr_rate * k / decay_step_size)`` and
    ``beta1 = max_mom * (1 + decay_mom_rate * k / decay_step_size)`` for the k-th step after it.

    As in DeepSpeed, momentum is cycled only for optimizers with ``betas`` (SGD's ``momentum`` is
    left alone, with a warning), and the written betas are ``(beta1, 0.99)``: beta2 is replaced.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        self.first_step_size = float(cycle_first_step_size)
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_second_stair_count
        if cycle_second_stair_count is None:
            self.second_stair_count = cycle_first_stair_count
        self.decay_step_size = decay_step_size
        no_decay_interval = math.isclose(decay_step_size, 0)

        self.min_lrs = per_group(cycle_min_lr, len(groups), "cycle_min_lr")
        self.max_lrs = per_group(cycle_max_lr, len(groups), "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_interval or math.isclose(decay_lr_rate, 0)
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)

        self.cycle_momentum = cycle_momentum
        self.skip_mom_decay = True
        if cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning("OneCycle: cycle_momentum off, %s has no 'betas'", type(self.optimizer).__name__)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(cycle_min_mom, 0.99)] * len(groups)
            self.max_moms = [(cycle_max_mom, 0.99)] * len(groups)
            self.skip_mom_decay = no_decay_interval or math.isclose(decay_mom_rate, 0)
            if last_batch_iteration == -1:
                for group, betas in zip(groups, self.min_moms):
                    group["betas"] = betas

    def _scale_factor(self) -> float:
        """Position in the cycle: 0 at the ends, 1 at the peak."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Hold the value flat over each stair. Quantised from the integer offset because the
            # float scale can land a hair under an exact stair and floor one stair too low.
            offset = iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_steps = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (decay_steps / self.decay_step_size)
        return [lr / factor for lr in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas every group gets at ``last_batch_iteration`` (None without cycle_momentum)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decay_steps = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (decay_steps / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step and write both the lrs and, with cycle_momentum, the betas."""
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas
