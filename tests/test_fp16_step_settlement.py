"""An fp16 step's outcome, settled after the step, is what DeepSpeed's immediate check gives.

The engine takes an fp16 step as applied and reads its overflow flag later (step_settlement.py):
at the next boundary, or when a user asks. What must come out exact: the LR each optimizer step
uses (DeepSpeed does not step the scheduler on an overflowed step), the weights of a skipped step,
skipped_steps, was_step_applied, and the overflow warning. Checked for an optimizer that skips on
the device (torch's fused AdamW, as the CPU masters here take) and one that cannot (SGD: one host
read in its step), against the schedule computed by hand.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerotrain

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}
OVERFLOW_AT = (1, 2, 4)  # two in a row: the second is settled only at the next boundary
STEPS = 6


def _warmup_lr(applied: int) -> float:
    """WarmupLR's LR after `applied` scheduler steps, from a scheduler of its own."""
    from zerotrain.optim import build_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = build_scheduler(WARMUP["type"], dict(WARMUP["params"]), opt)
    for _ in range(applied):
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("optimizer", [{"type": "AdamW", "params": {"lr": 0.1}}, {"type": "SGD", "params": {"lr": 0.1}}])
def test_settled_fp16_steps_use_deepspeeds_lr_and_keep_skipped_weights(optimizer, caplog):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, "scheduler": WARMUP,
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1},
        "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
    }
    engine, *_ = zerotrain.initialize(model=nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), config=config)
    inner = engine.optimizer.optimizer
    assert engine.optimizer.skips_on_device == (optimizer["type"] == "AdamW")
    used = []
    inner.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    changed = []
    logger = logging.getLogger("zerotrain")  # initialize() stops it propagating: attach the handler to it
    logger.addHandler(caplog.handler)
    try:
        for step in range(STEPS):
            before = [p.detach().clone() for p in engine.module.parameters()]
            x = torch.randn(4, 8)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss * float("inf") if step in OVERFLOW_AT else loss)
            engine.step()  # no accessor in between: each outcome settles at the next boundary
            changed.append(any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())))
        skipped = engine.skipped_steps  # settles the last step
    finally:
        logger.removeHandler(caplog.handler)
    applied = [s not in OVERFLOW_AT for s in range(STEPS)]
    assert changed == applied, "a skipped step left the weights as they were, an applied one changed them"
    # The LR each optimizer step saw. SGD is not called on a skipped step (read on the host).
    expected, count = [], 0
    for ok in applied:
        if ok or engine.optimizer.skips_on_device:
            expected.append(_warmup_lr(count))
        count += ok
    assert used == pytest.approx(expected)
    assert engine.get_lr() == pytest.approx([_warmup_lr(count)])
    assert skipped == len(OVERFLOW_AT) and engine.global_steps == STEPS
    assert engine.was_step_applied() is True
    warned = [r.getMessage() for r in caplog.records if "fp16 overflow at step" in r.getMessage()]
    assert [int(m.split("step ")[1].split(":")[0]) for m in warned] == list(OVERFLOW_AT)
    assert engine.optimizer.cur_scale == 2.0 ** (8 - len(OVERFLOW_AT)), "halved by each overflow, no growth yet"


def test_an_overflow_is_reported_as_soon_as_the_user_asks():
    config = {
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": WARMUP, "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerotrain.initialize(model=nn.Sequential(nn.Linear(8, 1)), config=config)
    engine.backward(engine(torch.randn(4, 8)).float().sum() * float("inf"))
    engine.step()
    assert engine.was_step_applied() is False and engine.skipped_steps == 1
    assert engine.get_lr() == [pytest.approx(_warmup_lr(0))] and engine.get_global_grad_norm() == float("inf")
