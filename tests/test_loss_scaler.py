"""DynamicLossScaler reproduces DeepSpeed's scale sequences.

All sequences use initial_scale_power 8 (scale 256), loss_scale_window 2, min_loss_scale 1, and
list the scale *used* at each step, i.e. read before `update_scale` is called for that step.

DeepSpeed's rules, as applied by hand below:
  * overflow: if hysteresis == 1 or the remaining budget is 1, scale = max(scale / 2, min);
    otherwise the budget drops by one and the scale stays. Either way last_overflow = step.
  * clean step: stable = step - last_overflow - 1 (last_overflow starts at -1); when stable > 0
    and stable % window == 0 the scale doubles and the budget is refilled. With
    consecutive_hysteresis the budget is refilled on every clean step instead.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zerotrain.runtime.precision import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
)


def make(hysteresis: int, consecutive: bool = False, **kw) -> DynamicLossScaler:
    return DynamicLossScaler(
        init_scale=2**8,
        scale_window=2,
        min_scale=1,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        **kw,
    )


def scales_used(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    used = []
    for overflow in overflows:
        used.append(scaler.loss_scale)
        scaler.update_scale(overflow)
    return used


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("consecutive", [False, True])
def test_no_overflow_doubles_every_window(hysteresis, consecutive):
    # stable after step k is k, so the scale doubles after steps 2, 4, 6, 8.
    expected = [256, 256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096]
    assert scales_used(make(hysteresis, consecutive), [False] * 10) == expected


def test_every_step_overflowing_hysteresis_1_halves_to_floor():
    # Each overflow halves at once; from 256 that is 8 halvings to reach 1, then it stays at 1.
    expected = [256, 128, 64, 32, 16, 8, 4, 2, 1, 1, 1]
    assert scales_used(make(1), [True] * 11) == expected


@pytest.mark.parametrize("consecutive", [False, True])
def test_every_step_overflowing_hysteresis_2_first_overflow_absorbed(consecutive):
    # The first overflow only spends the budget (2 -> 1); every later one halves.
    # No clean step ever happens, so consecutive_hysteresis cannot refill anything.
    expected = [256, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1]
    assert scales_used(make(2, consecutive), [True] * 11) == expected


def test_overflow_at_min_scale_can_raise_like_deepspeed():
    scaler = make(1, raise_error_at_min_scale=True)
    scales_used(scaler, [True] * 8)
    assert scaler.loss_scale == 1
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update_scale(True)


ALTERNATING = [True, False] * 5  # overflow on even steps, clean on odd ones


def test_alternating_hysteresis_1():
    # A clean step right after an overflow has stable = 0, so the scale never grows back:
    # it halves on every even step.
    expected = [256, 128, 128, 64, 64, 32, 32, 16, 16, 8]
    assert scales_used(make(1), ALTERNATING) == expected


def test_alternating_hysteresis_2_not_consecutive():
    # Step 0 spends the budget (2 -> 1). The clean steps never reach a window boundary, so the
    # budget is never refilled and every later overflow (steps 2, 4, ...) halves.
    expected = [256, 256, 256, 128, 128, 64, 64, 32, 32, 16]
    assert scales_used(make(2, consecutive=False), ALTERNATING) == expected


def test_alternating_hysteresis_2_consecutive():
    # Every clean step refills the budget to 2, so each overflow only spends one: never halves.
    assert scales_used(make(2, consecutive=True), ALTERNATING) == [256] * 10


def test_growth_refills_hysteresis():
    # Step 0 overflows (budget 2 -> 1). Clean steps 1..3: stable after step 3 is 3 - 0 - 1 = 2,
    # so the scale doubles to 512 and the budget is refilled to 2. Step 4 overflows and is
    # absorbed (2 -> 1); step 5 overflows and halves to 256.
    scaler = make(2)
    assert scales_used(scaler, [True, False, False, False, True, True]) == [256, 256, 256, 256, 512, 512]
    assert scaler.loss_scale == 256


def test_recovery_after_single_overflow():
    # Overflow at step 0 halves to 128 (hysteresis 1); stable after step k is k - 1, so growth
    # comes after steps 3, 5, 7.
    overflows = [True] + [False] * 8
    assert scales_used(make(1), overflows) == [256, 128, 128, 128, 256, 256, 512, 512, 1024]


def test_dynamic_state_dict_round_trip():
    scaler = make(2)
    scales_used(scaler, [True, False, True, False, False])
    state = scaler.state_dict()
    restored = make(2)
    restored.load_state_dict(state)
    tail = [False, True, False, False, False, True]
    assert scales_used(restored, tail) == scales_used(scaler, tail)
    assert restored.state_dict() == scaler.state_dict()


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128.0)
    assert scaler.dynamic is False
    for overflow in (True, False, True):
        scaler.update_scale(overflow)
    assert scaler.loss_scale == 128.0
    copy = StaticLossScaler(1.0)
    copy.load_state_dict(scaler.state_dict())
    assert copy.loss_scale == 128.0


def test_build_loss_scaler_disabled_returns_none():
    assert build_loss_scaler(SimpleNamespace(enabled=False, loss_scale=0)) is None
    assert build_loss_scaler(None) is None


def test_build_loss_scaler_dynamic_from_config_fields():
    cfg = SimpleNamespace(
        enabled=True,
        loss_scale=0,
        initial_scale_power=8,
        loss_scale_window=2,
        hysteresis=2,
        consecutive_hysteresis=True,
        min_loss_scale=0.5,
    )
    scaler = build_loss_scaler(cfg)
    assert isinstance(scaler, DynamicLossScaler) and scaler.dynamic is True
    assert scaler.loss_scale == 256
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (2, 2, 0.5)
    assert scaler.consecutive_hysteresis is True


def test_build_loss_scaler_defaults_match_deepspeed():
    scaler = build_loss_scaler({"enabled": True})
    assert scaler.loss_scale == 2**16
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (1000, 2, 1.0)
    assert scaler.consecutive_hysteresis is False


def test_build_loss_scaler_static():
    scaler = build_loss_scaler(SimpleNamespace(enabled=True, loss_scale=1024.0))
    assert isinstance(scaler, StaticLossScaler)
    assert scaler.loss_scale == 1024.0


# --- the device scaler: the same rules as tensor arithmetic --------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_device_scaler_follows_the_host_scaler_on_random_overflow_sequences(seed):
    import random

    import torch

    from zerotrain.runtime.precision import DeviceLossScaler

    rng = random.Random(seed)
    kw = dict(
        scale_factor=rng.choice([2.0, 3.0, 1.5]),  # not only powers of two: float64 state rounds as Python
        scale_window=rng.choice([1, 2, 3]),
        min_scale=rng.choice([1.0, 4.0, 0.5]),
        delayed_shift=rng.choice([1, 2, 3]),
        consecutive_hysteresis=rng.choice([False, True]),
    )
    host = DynamicLossScaler(init_scale=2**8, **kw)
    device = DeviceLossScaler(DynamicLossScaler(init_scale=2**8, **kw), torch.device("cpu"))
    p_overflow = rng.choice([0.1, 0.4, 0.8])
    for step in range(200):
        overflow = rng.random() < p_overflow
        assert device.loss_scale == host.loss_scale, (seed, step, kw)
        host.update_scale(overflow)
        device.update_scale(torch.tensor(float(overflow)))
        assert device.settle() is overflow
        assert device.state_dict() == host.state_dict(), (seed, step, kw)


def test_device_scaler_raises_at_the_minimum_when_settled():
    import torch

    from zerotrain.runtime.precision import DeviceLossScaler

    host = DynamicLossScaler(init_scale=2**8, min_scale=128, raise_error_at_min_scale=True)
    device = DeviceLossScaler(host, torch.device("cpu"))
    device.update_scale(torch.tensor(1.0))  # 256 -> 128
    assert device.settle() is True
    device.update_scale(torch.tensor(1.0))  # at the floor: the host version raises here
    with pytest.raises(LossScaleAtMinimumError):
        device.settle()


def test_device_scaler_state_dict_loads_into_the_host_scaler_and_back():
    import torch

    from zerotrain.runtime.precision import DeviceLossScaler

    device = DeviceLossScaler(make(2), torch.device("cpu"))
    for overflow in (1.0, 0.0, 0.0, 1.0, 1.0):
        device.update_scale(torch.tensor(overflow))
    host = make(2)
    host.load_state_dict(device.state_dict())
    again = DeviceLossScaler(make(2), torch.device("cpu"))
    again.load_state_dict(host.state_dict())
    assert again.state_dict() == device.state_dict() == host.state_dict()
    assert again.scale.dtype == torch.float32 and again.scale.item() == host.loss_scale
