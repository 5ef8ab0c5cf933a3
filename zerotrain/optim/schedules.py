"""DeepSpeed's learning-rate schedules, driven once per optimizer step.

Each schedule writes its lr into the optimizer's param groups when built (unless resuming with
``last_batch_iteration >= 0``) and again on every `step()`, with the formulas, parameter names and
defaults of ``deepspeed.runtime.lr_schedules``, so a DeepSpeed config yields the same lr at every
step. ``last_batch_iteration`` counts completed optimizer steps minus one: -1 before training,
0 after the first `step()`.

`build_scheduler` also accepts the name of any torch.optim.lr_scheduler class, as DeepSpeed does.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from zerotrain.config.errors import ConfigError
from zerotrain.optim.cyclic_schedules import LRRangeTest, OneCycle
from zerotrain.optim.schedule_base import (
    POSITIONAL, WARMUP_LOG_RATE, StepSchedule, checked_warmup_steps, checked_warmup_type, logger,
    per_group, torch_optimizer, warmup_fraction,
)

__all__ = ["SCHEDULES", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler"]


class WarmupLR(StepSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    lr = min + (max - min) * gamma with gamma = log(i + 1) / log(N) ("log") or i / N ("linear")
    for i < N and 1 afterwards. ``warmup_max_lr`` defaults to each group's configured lr.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        warmup_num_steps = checked_warmup_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        self.min_lrs = per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = checked_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    After warmup, gamma = max(0, (T - i) / max(1, T - N)).
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(StepSchedule):
    """Scale each group's own lr: warm up from ``warmup_min_ratio`` to 1, then cosine-decay.

    Warmup (i < N): ratio = wmin + (1 - wmin) * fraction, fraction as in `WarmupLR`.
    Decay: p = min(1, (i - N + 1) / max(1, T - N)),
    ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2), held at ``cos_min_ratio`` past T.
    The lr written at construction is 0, as DeepSpeed does before the first step.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        warmup_num_steps = checked_warmup_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = checked_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's original lr at ``last_batch_iteration``."""
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            fraction = warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / decay_span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES: dict[str, type[StepSchedule]] = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def _torch_schedules() -> dict[str, type]:
    from torch.optim import lr_scheduler as torch_schedules

    base = torch_schedules.LRScheduler
    return {
        name: obj
        for name, obj in vars(torch_schedules).items()
        if inspect.isclass(obj) and obj is not base and (issubclass(obj, base) or name == "ReduceLROnPlateau")
    }


def build_scheduler(type_name: str, params: Mapping[str, Any] | None, optimizer: Any) -> Any:
    """Create the schedule a DeepSpeed ``{"type": ..., "params": {...}}`` section describes.

    Args:
        type_name: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR or WarmupCosineLR
            (case-insensitive), or the name of a torch.optim.lr_scheduler class.
        params: the section's ``params``, passed as keyword arguments.
        optimizer: the torch optimizer (or a wrapper exposing it as ``.optimizer``).

    Raises:
        ConfigError: unknown type, unknown parameter, or a required parameter missing.
    """
    catalogue: dict[str, type] = {**_torch_schedules(), **SCHEDULES}
    by_lower = {name.lower(): name for name in catalogue}
    canonical = by_lower.get(str(type_name).lower())
    if canonical is None:
        hint = difflib.get_close_matches(str(type_name).lower(), list(by_lower), n=1, cutoff=0.5)
        did_you_mean = f" (did you mean {by_lower[hint[0]]!r}?)" if hint else ""
        raise ConfigError(
            f"unknown scheduler type {type_name!r}{did_you_mean}; supported: {', '.join(SCHEDULES)} "
            "or a torch.optim.lr_scheduler class name"
        )
    cls = catalogue[canonical]
    signature = inspect.signature(cls.__init__)
    accepted = [n for n in signature.parameters if n not in ("self", "optimizer")]
    options = dict(params or {})
    for key in options:
        if key not in accepted:
            hint = difflib.get_close_matches(key, accepted, n=1, cutoff=0.5)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"scheduler {canonical}: unknown parameter {key!r}{did_you_mean} (accepted: {', '.join(accepted)})"
            )
    required = [n for n in accepted if signature.parameters[n].default is inspect.Parameter.empty]
    missing = [n for n in required if n not in options and signature.parameters[n].kind is POSITIONAL]
    if missing:
        raise ConfigError(f"scheduler {canonical}: missing required parameter(s) {', '.join(missing)}")
    target = optimizer if canonical in SCHEDULES else torch_optimizer(optimizer)
    return cls(target, **options)
