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
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none")


def _per_group(value: float | Sequence[float], count: int, name: str) -> list[float]:
    """A scalar repeated per param group, or a per-group list checked for length."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{name}: expected {count} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * count


def _checked_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        # DeepSpeed does not fail here either: it warns and warms up logarithmically.
        logger.warning("unknown warmup_type %r, using 'log' (expected 'log' or 'linear')", warmup_type)
        return WARMUP_LOG_RATE
    return warmup_type


def _checked_warmup_steps(warmup_num_steps: Any) -> int:
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


def _warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1): log(step + 1) / log(N) or step / N."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


class _StepSchedule:
    """Shared driver: the lr for ``last_batch_iteration`` is written on every `step()`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
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


class LRRangeTest(_StepSchedule):
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
        self.min_lr = _per_group(lr_range_test_min_lr, len(self.optimizer.param_groups), "lr_range_test_min_lr")
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


class OneCycle(_StepSchedule):
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

        self.min_lrs = _per_group(cycle_min_lr, len(groups), "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, len(groups), "cycle_max_lr")
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


class WarmupLR(_StepSchedule):
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
        warmup_num_steps = _checked_warmup_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = _checked_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
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
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_StepSchedule):
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
        warmup_num_steps = _checked_warmup_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _checked_warmup_type(warmup_type)
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
            fraction = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / decay_span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES: dict[str, type[_StepSchedule]] = {
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
    missing = [n for n in required if n not in options and signature.parameters[n].kind is _POSITIONAL]
    if missing:
        raise ConfigError(f"scheduler {canonical}: missing required parameter(s) {', '.join(missing)}")
    target = optimizer if canonical in SCHEDULES else _torch_optimizer(optimizer)
    return cls(target, **options)
