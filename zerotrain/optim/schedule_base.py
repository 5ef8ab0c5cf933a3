"""What every DeepSpeed learning-rate schedule shares: one lr per param group, written on build and
on every `step()`, resumable from ``last_batch_iteration``; and the warm-up arithmetic.
The schedules themselves: `schedules.py` (warm-ups) and `cyclic_schedules.py` (LRRangeTest, OneCycle).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from zerotrain.config.errors import ConfigError

logger = logging.getLogger(__name__)

WARMUP_LOG_RATE = "log"

WARMUP_LINEAR_RATE = "linear"

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none")


def per_group(value: float | Sequence[float], count: int, name: str) -> list[float]:
    """A scalar repeated per param group, or a per-group list checked for length."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{name}: expected {count} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * count


def checked_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        # DeepSpeed does not fail here either: it warns and warms up logarithmically.
        logger.warning("unknown warmup_type %r, using 'log' (expected 'log' or 'linear')", warmup_type)
        return WARMUP_LOG_RATE
    return warmup_type


def checked_warmup_steps(warmup_num_steps: Any) -> int:
    """The warmup length used: at least 2, so that log(warmup_num_steps) is not 0, as DeepSpeed's.

    0 is accepted, as DeepSpeed up to 0.19.2 accepts it (0.19.3 and later reject it): it is
    raised to 2 like 1 is, so the lr still starts at ``warmup_min_lr``. Negative values and
    non-integers are refused.
    """
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
        raise ConfigError(
            f"warmup_num_steps must be a non-negative integer, got {warmup_num_steps!r}: "
            "set scheduler.params.warmup_num_steps to the number of warmup steps (0 or more)"
        )
    if warmup_num_steps == 0:
        logger.warning(
            "warmup_num_steps 0 warms up over 2 steps, as in DeepSpeed 0.19.2 and earlier (the first step "
            "uses warmup_min_lr); DeepSpeed 0.19.3 and later reject 0"
        )
    return max(2, warmup_num_steps)


def warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1): log(step + 1) / log(N) or step / N."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


class StepSchedule:
    """Shared driver: the lr for ``last_batch_iteration`` is written on every `step()`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        """The lr of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written to the optimizer."""
        if self._last_lr is None:
            raise RuntimeError("no lr set yet: call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``) and set the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state; the configuration comes from the config on resume."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the step counter; the lrs are rewritten on the next `step()`."""
        self.last_batch_iteration = state["last_batch_iteration"]

    def _apply(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                # Tensor lrs (capturable/fused optimizers) are updated in place to keep identity.
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]
