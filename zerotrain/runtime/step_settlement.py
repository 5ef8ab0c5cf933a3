"""Settling an fp16 step's outcome after the step, so that the step itself reads nothing.

With fp16, whether a boundary step applied (no inf/nan in any rank's gradients) is a flag on the
device. Reading it inside the step would make the host wait for the GPU every step, so the engine
takes the step as applied at once — the LR scheduler steps, `was_step_applied()` is True — and
settles the flag later: at the next boundary (when the GPU has long finished it), or as soon as a
user asks for something that depends on it (`skipped_steps`, `get_lr()`, `was_step_applied()`, a
progress line, a checkpoint). An overflow then counts the skip, logs DeepSpeed's warning, and rolls
the scheduler and the optimizer's hyper-parameters back to before the step (DeepSpeed does not step
the scheduler on an overflowed step), before the next step can use them.

One consequence: between an overflowed step and its settling, a scheduler read directly (not
through the engine) shows the LR one step ahead.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch

log = logging.getLogger("zerotrain")


class LateRead:
    """A device tensor copied to the host as it is produced, read later without waiting on the GPU.

    On CUDA the copy goes to pinned memory behind an event; reading waits for that event only (not
    for the work queued since). On the CPU the tensor is already there.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._host = tensor

    def values(self) -> list:
        """The tensor's values as Python numbers."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class StepSettlement:
    """The engine's part that counts skipped steps and settles fp16 outcomes (a mixin of `Engine`)."""

    lr_scheduler: Any
    optimizer: Any
    loss_scaler: Any
    rank: int
    global_steps: int
    _step_applied: bool
    _pending_step: tuple | None = None  # (LateRead of the scaler's record, step, rollback state)
    _skipped: int = 0

    @property
    def skipped_steps(self) -> int:
        """Boundary steps skipped for fp16 overflow (DeepSpeed's attribute); settles a pending step."""
        self._settle_step()
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._pending_step = None  # a value set from outside (a checkpoint) replaces what was pending
        self._skipped = int(value)

    def _boundary_step_done(self) -> None:
        """After the optimizer's step (the previous one settled): steps the scheduler, leaving an
        fp16 step to be settled."""
        self._step_applied = True
        event = self.loss_scaler.take_event() if self.loss_scaler is not None else None
        if event is not None:
            self._pending_step = (LateRead(event), self.global_steps, self._hyperparameters())
        self._step_scheduler()

    def _settle_step(self) -> None:
        """Reads the pending fp16 step's outcome (it has finished by now) and applies it."""
        pending, self._pending_step = self._pending_step, None
        if pending is None:
            return
        record, step, before = pending
        if not self.loss_scaler.report(record.values()):
            return
        self._restore_hyperparameters(before)
        self._step_applied = False  # already False if a micro-step has been taken since
        self._skipped += 1
        if self.rank == 0:
            log.warning(
                "fp16 overflow at step %d: update skipped, loss scale now %s", step, self.loss_scaler.loss_scale
            )

    def _step_scheduler(self) -> None:
        if self.lr_scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            self.lr_scheduler.step()

    def _hyperparameters(self) -> tuple[list[dict], dict | None]:
        """What a scheduler step changes: every group's settings and the scheduler's own state."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        sched = self.lr_scheduler
        state = copy.deepcopy(sched.state_dict()) if sched is not None and hasattr(sched, "state_dict") else None
        return groups, state

    def _restore_hyperparameters(self, before: tuple[list[dict], dict | None]) -> None:
        groups, state = before
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)
        if state is not None:
            self.lr_scheduler.load_state_dict(state)
