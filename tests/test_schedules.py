"""LR schedules against DeepSpeed's closed-form formulas.

Convention: `step()` is called once per optimizer step; after the (i+1)-th call
last_batch_iteration is i and the lr written to the optimizer is f(i).
"""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.config.errors import ConfigError
from zerotrain.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def sgd(*lrs: float) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def adamw(lr: float = 0.1) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def lrs_after_steps(scheduler, optimizer, count: int) -> list[list[float]]:
    """lrs in the optimizer after each of `count` step() calls (index i -> iteration i)."""
    out = []
    for _ in range(count):
        scheduler.step()
        out.append([g["lr"] for g in optimizer.param_groups])
    return out


def test_warmup_lr_log():
    opt = sgd(0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.001  # min lr before the first step
    seen = lrs_after_steps(sched, opt, 15)
    for i in (0, 1, 4, 9, 10, 14):
        gamma = math.log(i + 1) / math.log(10) if i < 10 else 1.0
        assert seen[i][0] == pytest.approx(0.001 + 0.009 * gamma)
    assert sched.get_last_lr() == seen[-1]


def test_warmup_lr_linear_and_default_max_is_group_lr():
    opt = sgd(0.2, 0.04)
    sched = WarmupLR(opt, warmup_num_steps=8, warmup_type="linear")
    seen = lrs_after_steps(sched, opt, 12)
    for i in (0, 3, 7, 8, 11):
        gamma = i / 8 if i < 8 else 1.0
        assert seen[i] == pytest.approx([0.2 * gamma, 0.04 * gamma])


def test_warmup_num_steps_below_two_is_raised_to_two():
    opt = sgd(1.0)
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert [lr[0] for lr in lrs_after_steps(sched, opt, 3)] == pytest.approx([0.0, 0.5, 1.0])


def test_warmup_decay_lr():
    opt = sgd(0.5)
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    seen = lrs_after_steps(sched, opt, 25)
    for i in (0, 5, 9):
        assert seen[i][0] == pytest.approx(0.01 * i / 10)
    for i in (10, 15, 19, 20, 24):
        assert seen[i][0] == pytest.approx(0.01 * max(0.0, (20 - i) / 10))


def test_warmup_decay_lr_log_warmup():
    opt = sgd(0.5)
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_max_lr=0.02, warmup_num_steps=10)
    seen = lrs_after_steps(sched, opt, 60)
    assert seen[4][0] == pytest.approx(0.02 * math.log(5) / math.log(10))
    assert seen[55][0] == pytest.approx(0.02 * (100 - 55) / 90)


def cosine_ratio(i: int, total: int, warmup: int, wmin: float, cmin: float) -> float:
    if i < warmup:
        return wmin + (i / warmup) * (1 - wmin)
    progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
    return max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)


def test_warmup_cosine_lr_scales_each_group():
    opt = sgd(1.0, 0.5)
    sched = WarmupCosineLR(
        opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01, warmup_type="linear"
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # DeepSpeed writes 0 before step 1
    seen = lrs_after_steps(sched, opt, 30)
    for i in (0, 2, 4, 5, 10, 18, 19, 25, 29):
        ratio = cosine_ratio(i, 20, 5, 0.1, 0.01)
        assert seen[i] == pytest.approx([1.0 * ratio, 0.5 * ratio])
    assert seen[19][0] == pytest.approx(0.01)  # end of decay: cos_min_ratio, then held
    assert seen[29][0] == pytest.approx(0.01)


def test_warmup_cosine_lr_log_warmup():
    opt = sgd(2.0)
    sched = WarmupCosineLR(opt, total_num_steps=50, warmup_num_steps=10)
    seen = lrs_after_steps(sched, opt, 5)
    assert seen[4][0] == pytest.approx(2.0 * math.log(5) / math.log(10))


def test_lr_range_test_continuous_and_staircase():
    opt = sgd(0.5)
    cont = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=0.5)
    assert opt.param_groups[0]["lr"] == 0.01
    seen = lrs_after_steps(cont, opt, 10)
    for i in (0, 3, 7, 9):
        assert seen[i][0] == pytest.approx(0.01 * (1 + 0.5 * (i + 1) / 4))

    opt = sgd(0.5)
    stairs = LRRangeTest(
        opt,
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=4,
        lr_range_test_step_rate=0.5,
        lr_range_test_staircase=True,
    )
    seen = [lr[0] for lr in lrs_after_steps(stairs, opt, 9)]
    # floor((i + 1) / 4): 0,0,0,1,1,1,1,2,2
    assert seen == pytest.approx([0.01 * (1 + 0.5 * k) for k in (0, 0, 0, 1, 1, 1, 1, 2, 2)])


def test_one_cycle_phases_and_momentum():
    opt = adamw()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        decay_lr_rate=0.5,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.1,
    )
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)
    lrs, betas = [], []
    for _ in range(14):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(opt.param_groups[0]["betas"])

    def scale(i: int) -> float:  # up for 4 iterations, down for 6, on (i + 1)
        it = i + 1
        return it / 4 if it <= 4 else (10 - it) / 6

    for i in (0, 1, 3, 6, 8):
        assert lrs[i] == pytest.approx(0.01 + 0.09 * scale(i))
        assert betas[i][0] == pytest.approx(0.95 - 0.1 * scale(i))
        assert betas[i][1] == 0.99
    assert lrs[3] == pytest.approx(0.1)  # the peak
    assert lrs[9] == pytest.approx(0.01)  # cycle over
    for i in (10, 11, 13):  # decay phase, k = i - 10 + 1 steps into it
        k = i - 9
        assert lrs[i] == pytest.approx(0.01 / (1 + 0.5 * k / 2))
        assert betas[i][0] == pytest.approx(0.95 * (1 + 0.1 * k / 2))


def test_one_cycle_without_decay_holds_min_lr_and_sgd_keeps_momentum():
    opt = sgd(0.3)
    opt.param_groups[0]["momentum"] = 0.9
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert sched.cycle_momentum is False  # SGD has no betas: DeepSpeed disables it too
    seen = [lr[0] for lr in lrs_after_steps(sched, opt, 8)]
    assert seen == pytest.approx([0.055, 0.1, 0.055, 0.01, 0.01, 0.01, 0.01, 0.01])
    assert opt.param_groups[0]["momentum"] == 0.9


def test_one_cycle_staircase():
    opt = sgd(0.3)
    sched = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    seen = [lr[0] for lr in lrs_after_steps(sched, opt, 8)]
    # (i + 1) up the first 4 then down: positions 0.5,1,1.5,2,1.5,1,0.5,0 stairs, floored /2
    assert seen == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize(
    "type_name, params",
    [
        ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 10}),
        ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 10}),
        ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 10}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5}),
        ("LRRangeTest", {"lr_range_test_step_size": 3}),
    ],
)
def test_state_dict_round_trip(type_name, params):
    opt = adamw()
    sched = build_scheduler(type_name, params, opt)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 6}

    resumed_opt = adamw()
    resumed = build_scheduler(type_name, params, resumed_opt)
    resumed.load_state_dict(state)
    for _ in range(5):
        sched.step()
        resumed.step()
        assert resumed_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
        assert resumed_opt.param_groups[0]["betas"] == pytest.approx(opt.param_groups[0]["betas"])


def test_build_scheduler_case_insensitive_and_wrapped_optimizer():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    opt = sgd(0.1)
    sched = build_scheduler("warmuplr", {"warmup_max_lr": 0.1, "warmup_num_steps": 4}, Wrapper(opt))
    assert isinstance(sched, WarmupLR)
    assert sched.optimizer is opt


def test_build_scheduler_unknown_type_suggests():
    with pytest.raises(ConfigError, match="WarmupCosineLR"):
        build_scheduler("WarmupCosine", {}, sgd(0.1))


def test_build_scheduler_unknown_param_suggests():
    with pytest.raises(ConfigError) as err:
        build_scheduler("WarmupLR", {"warmup_max_lrr": 0.1}, sgd(0.1))
    message = str(err.value)
    assert "warmup_max_lrr" in message and "did you mean 'warmup_max_lr'" in message and "WarmupLR" in message


def test_build_scheduler_missing_required_param():
    with pytest.raises(ConfigError, match="cycle_max_lr"):
        build_scheduler("OneCycle", {"cycle_min_lr": 0.01}, sgd(0.1))


def test_build_scheduler_bad_warmup_steps():
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        build_scheduler("WarmupLR", {"warmup_num_steps": -1}, sgd(0.1))


def test_build_scheduler_falls_back_to_torch():
    opt = sgd(1.0)
    sched = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
