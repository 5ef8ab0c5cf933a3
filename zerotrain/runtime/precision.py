"""Loss scaling for fp16 training, with DeepSpeed's dynamic-scale rules.

fp16 gradients underflow easily, so the loss is multiplied by a scale before backward and the
gradients are divided by it before the optimizer step. A dynamic scaler shrinks the scale when a
step overflows (the step is then skipped by the caller) and grows it again after a window of
clean steps. The update rule below reproduces DeepSpeed's `DynamicLossScaler.update_scale`
step for step, hysteresis included, so a run resumed or compared against DeepSpeed sees the same
scale sequence.

bf16 and fp32 need no scaling: `build_loss_scaler` returns None for them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

# DeepSpeed's fp16 section defaults.
DEFAULT_INITIAL_SCALE_POWER = 16
DEFAULT_LOSS_SCALE_WINDOW = 1000
DEFAULT_HYSTERESIS = 2
DEFAULT_MIN_LOSS_SCALE = 1.0


class LossScaleAtMinimumError(RuntimeError):
    """Raised when a step overflows at the minimum scale and the scaler was told to give up."""


class LossScaler:
    """What both scalers share: the current scale and how the loss is multiplied by it."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale``."""
        return loss * self.cur_scale


class StaticLossScaler(LossScaler):
    """A fixed loss scale (fp16 config with a non-zero ``loss_scale``)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"a static loss scale must be positive, got {scale}")
        self.cur_scale = float(scale)

    def update_scale(self, overflow: bool) -> None:
        """A static scale never changes; present so callers need not special-case it."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` produced."""
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed-compatible dynamic loss scale.

    Args:
        init_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        scale_factor: the scale is divided / multiplied by this on overflow / growth.
        scale_window: clean steps since the last overflow needed before each growth.
        min_scale: the scale never drops below this.
        delayed_shift: DeepSpeed's ``hysteresis``: how many overflows are tolerated before the
            scale is actually reduced.
        consecutive_hysteresis: refill the hysteresis budget after every clean step instead of
            only when the scale grows.
        raise_error_at_min_scale: raise `LossScaleAtMinimumError` when a step overflows while
            the scale already sits at ``min_scale`` (DeepSpeed's own default is to raise; here
            the default keeps training at the floor and skipping steps).
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if not min_scale > 0:
            raise ValueError(f"min_scale must be positive, got {min_scale}")
        if int(scale_window) < 1 or int(delayed_shift) < 1:
            raise ValueError("scale_window and delayed_shift (hysteresis) must be >= 1")
        self.cur_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Advance one step; ``overflow`` says whether this step's gradients had inf/nan."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                # The hysteresis budget is spent: actually shrink the scale.
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum "
                        f"({self.min_scale}); training has diverged. Lower the learning rate, or set "
                        f"fp16.min_loss_scale lower"
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info("fp16 overflow, skipping step: loss scale %g -> %g", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                logger.info(
                    "fp16 overflow, skipping step: loss scale %g kept, hysteresis %d -> %d",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            # Steps since the last overflow, not counting this one; growth happens on every
            # multiple of the window (DeepSpeed counts it this way, so the first growth comes one
            # step later than a naive "window clean steps" reading would suggest).
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (the counters as well as the scale)."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the runtime state; the window, factor and limits stay as configured now."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


LossScaler = StaticLossScaler | DynamicLossScaler


class DeviceLossScaler:
    """A loss scaler whose scale and counters live on the training device: no host reads in a step.

    Built from a host scaler (`StaticLossScaler` or `DynamicLossScaler`), whose rules it applies
    as tensor arithmetic, equal step for step (`update_scale`). What the host version does at once,
    this one leaves to `report` (or `settle`), called when the step has long finished: the log line of a shrink
    or a spent hysteresis, and `LossScaleAtMinimumError` (raised then, one step late). The state is
    kept in float64/int64 so a scale factor that is not a power of two rounds as on the host.
    """

    def __init__(self, host: StaticLossScaler | DynamicLossScaler, device: torch.device) -> None:
        self.dynamic = host.dynamic
        self.host = host  # the configuration (factor, window, limits); its own state is not used
        self.device = torch.device(device)
        self._event: torch.Tensor | None = None  # [overflow, scale before, scale after, hysteresis before]
        self.load_state_dict(host.state_dict())

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, an fp32 device scalar: multiplies the loss, divides the gradients."""
        return self._scale32

    @property
    def loss_scale(self) -> float:
        """The current scale as a number: a host read, for logs and users who ask."""
        return float(self._scale.item())

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for `loss_scale`."""
        return self.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * scale`` without reading the scale."""
        return loss * self._scale32

    def update_scale(self, overflow: torch.Tensor) -> None:
        """Advance one step on the device; ``overflow`` is a scalar tensor, non-zero when the step
        overflowed. Records what `settle` reports."""
        ov = overflow.to(self.device) != 0
        before, hysteresis = self._scale, self._hysteresis
        if self.dynamic:
            h = self.host
            shrink = ov & ((self._hysteresis == 1) | (h.delayed_shift == 1))
            stable = self._iter - self._last_overflow - 1
            grow = ~ov & (stable > 0) & (stable % h.scale_window == 0)
            shrunk = (before / h.scale_factor).clamp(min=h.min_scale)
            self._scale = torch.where(shrink, shrunk, torch.where(grow, before * h.scale_factor, before))
            refill = ~ov if h.consecutive_hysteresis else grow
            spent = torch.where(ov & ~shrink, hysteresis - 1, hysteresis)
            self._hysteresis = torch.where(refill, torch.full_like(hysteresis, h.delayed_shift), spent)
            self._last_overflow = torch.where(ov, self._iter, self._last_overflow)
            self._iter = self._iter + 1
            self._scale32 = self._scale.float()
        self._event = torch.stack([ov.double(), before, self._scale, hysteresis.double()])

    def settle(self) -> bool | None:
        """Reads the last update's record (a host read) and `report`s it; None when none is pending."""
        if self._event is None:
            return None
        record, self._event = self._event.tolist(), None
        return self.report(record)

    def report(self, record: list[float]) -> bool:
        """Logs an update's record (`pending_event`, read once the step has finished) as the host
        scaler does, and raises `LossScaleAtMinimumError` where it would have. Returns whether that
        step overflowed."""
        overflow, before, after, hysteresis = record
        if overflow and self.dynamic:
            h = self.host
            if h.delayed_shift == 1 or hysteresis == 1:
                if before == h.min_scale and h.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum "
                        f"({h.min_scale}); training has diverged. Lower the learning rate, or set "
                        f"fp16.min_loss_scale lower"
                    )
                logger.info("fp16 overflow, skipping step: loss scale %g -> %g", before, after)
            else:
                logger.info(
                    "fp16 overflow, skipping step: loss scale %g kept, hysteresis %d -> %d",
                    before, hysteresis, hysteresis - 1,
                )
        return bool(overflow)

    def take_event(self) -> torch.Tensor | None:
        """The last update's record, handed over for a later `report` (None if none is pending)."""
        event, self._event = self._event, None
        return event

    def state_dict(self) -> dict[str, Any]:
        """The host scaler's checkpoint keys and values (a host read: on save only)."""
        state = {"cur_scale": self.loss_scale}
        if self.dynamic:
            state.update(
                cur_iter=int(self._iter.item()),
                last_overflow_iter=int(self._last_overflow.item()),
                cur_hysteresis=int(self._hysteresis.item()),
            )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` (this one's or a host scaler's) produced."""
        self.host.load_state_dict(state)  # validates and converts as the host does
        h, dev = self.host, self.device
        self._scale = torch.tensor(h.cur_scale, dtype=torch.float64, device=dev)
        self._scale32 = self._scale.float()
        if self.dynamic:
            self._iter = torch.tensor(h.cur_iter, dtype=torch.int64, device=dev)
            self._last_overflow = torch.tensor(h.last_overflow_iter, dtype=torch.int64, device=dev)
            self._hysteresis = torch.tensor(h.cur_hysteresis, dtype=torch.int64, device=dev)
        else:
            self._hysteresis = torch.ones((), dtype=torch.int64, device=dev)
        self._event = None


def _setting(cfg: Any, name: str, default: Any) -> Any:
    """Read ``name`` from an attribute-style config object or a plain mapping."""
    if isinstance(cfg, Mapping):
        value = cfg.get(name, default)
    else:
        value = getattr(cfg, name, default)
    return default if value is None else value


def build_loss_scaler(fp16_cfg: Any) -> LossScaler | None:
    """Build the scaler an fp16 config section asks for, or None when fp16 is off.

    ``fp16_cfg`` may be any object (or mapping) with DeepSpeed's fp16 fields: ``enabled``,
    ``loss_scale`` (0 means dynamic), ``initial_scale_power``, ``loss_scale_window``,
    ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale`` and optionally
    ``raise_error_at_min_scale``. Missing fields take DeepSpeed's defaults.
    """
    if fp16_cfg is None or not _setting(fp16_cfg, "enabled", False):
        return None
    loss_scale = float(_setting(fp16_cfg, "loss_scale", 0.0))
    if loss_scale != 0:
        return StaticLossScaler(loss_scale)
    power = _setting(fp16_cfg, "initial_scale_power", DEFAULT_INITIAL_SCALE_POWER)
    return DynamicLossScaler(
        init_scale=2.0 ** power,
        scale_window=_setting(fp16_cfg, "loss_scale_window", DEFAULT_LOSS_SCALE_WINDOW),
        min_scale=_setting(fp16_cfg, "min_loss_scale", DEFAULT_MIN_LOSS_SCALE),
        delayed_shift=_setting(fp16_cfg, "hysteresis", DEFAULT_HYSTERESIS),
        consecutive_hysteresis=_setting(fp16_cfg, "consecutive_hysteresis", False),
        raise_error_at_min_scale=_setting(fp16_cfg, "raise_error_at_min_scale", False),
    )
