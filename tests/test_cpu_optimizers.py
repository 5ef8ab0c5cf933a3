"""DeepSpeed's CPU optimizer stand-ins: torch's update rules, DeepSpeed's arguments and semantics."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.runtime.engine import _constructor_kwargs
from zerotrain.optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, Lion

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _train(make_optimizer, steps: int = STEPS) -> list[torch.Tensor]:
    """Parameters after `steps` updates of a fresh model by `make_optimizer(params)`."""
    model = _model()
    opt = make_optimizer(model.parameters())
    for s in range(steps):
        x, y = _batch(s)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_cpu_adam_in_adamw_mode_matches_torch_adamw():
    got = _train(lambda p: DeepSpeedCPUAdam(p, lr=0.05, weight_decay=0.1, adamw_mode=True))
    _assert_same(got, _train(lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=True)))


def test_cpu_adam_without_adamw_mode_matches_torch_adam_l2():
    got = _train(lambda p: DeepSpeedCPUAdam(p, lr=0.05, weight_decay=0.1, adamw_mode=False))
    _assert_same(got, _train(lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1, foreach=True)))


def test_adamw_mode_changes_the_update():
    decoupled = _train(lambda p: DeepSpeedCPUAdam(p, lr=0.05, weight_decay=0.5, adamw_mode=True))
    l2 = _train(lambda p: DeepSpeedCPUAdam(p, lr=0.05, weight_decay=0.5, adamw_mode=False))
    assert not torch.allclose(decoupled[0], l2[0])


def _adam_without_bias_correction(lr, betas, eps, wd, decoupled):
    """Reference: Adam with raw moments, written out per parameter."""

    class Reference(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                st = self.state[p]
                m, v = st.get("m", torch.zeros_like(p)), st.get("v", torch.zeros_like(p))
                g = p.grad if decoupled else p.grad + wd * p
                st["m"] = betas[0] * m + (1 - betas[0]) * g
                st["v"] = betas[1] * v + (1 - betas[1]) * g * g
                decayed = p * (1 - lr * wd) if decoupled else p
                p.copy_(decayed - lr * st["m"] / (st["v"].sqrt() + eps))

    return Reference


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_without_bias_correction_uses_raw_moments(adamw_mode):
    kw = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    got = _train(lambda p: DeepSpeedCPUAdam(p, bias_correction=False, adamw_mode=adamw_mode, **kw))
    reference = _adam_without_bias_correction(0.01, (0.8, 0.9), 1e-6, 0.2, decoupled=adamw_mode)
    _assert_same(got, _train(reference))
    # Bias correction does matter over these steps: the flag is not a no-op.
    corrected = _train(lambda p: DeepSpeedCPUAdam(p, bias_correction=True, adamw_mode=adamw_mode, **kw))
    assert not torch.allclose(got[0], corrected[0])


def test_cpu_adam_refuses_amsgrad_like_deepspeed():
    params = list(_model().parameters())
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(params, amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam([{"params": params, "amsgrad": True}])


def test_cpu_adagrad_matches_torch_adagrad():
    got = _train(lambda p: DeepSpeedCPUAdagrad(p, lr=0.05, weight_decay=0.1))
    _assert_same(got, _train(lambda p: torch.optim.Adagrad(p, lr=0.05, weight_decay=0.1, foreach=True)))


def test_cpu_lion_matches_lion_with_deepspeed_betas():
    got = _train(lambda p: DeepSpeedCPULion(p, lr=0.01, weight_decay=0.1))
    _assert_same(got, _train(lambda p: Lion(p, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1)))


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (DeepSpeedCPUAdam, dict(lr=0.2, bias_correction=False, betas=(0.8, 0.9), eps=1e-5, weight_decay=0.3,
                                amsgrad=False, adamw_mode=False, fp32_optimizer_states=False)),
        (DeepSpeedCPUAdagrad,
         dict(lr=0.2, eps=1e-5, weight_decay=0.3, amsgrad=True, fp32_optimizer_states=False)),
        (DeepSpeedCPULion, dict(lr=0.2, betas=(0.8, 0.9), weight_decay=0.3, fp32_optimizer_states=False)),
    ],
)
def test_constructor_arguments_round_trip_through_defaults(cls, kwargs):
    opt = cls(_model().parameters(), **kwargs)
    assert isinstance(opt, torch.optim.Optimizer)
    # What zerotrain's engine does with a client optimizer.
    assert _constructor_kwargs(cls, opt.defaults) == kwargs


@pytest.mark.parametrize(
    "torch_cls, expected_cls, adamw_mode",
    [
        (torch.optim.AdamW, DeepSpeedCPUAdam, True),
        (torch.optim.Adam, DeepSpeedCPUAdam, False),
        (torch.optim.Adagrad, DeepSpeedCPUAdagrad, None),
    ],
)
def test_accelerate_maps_torch_optimizers_onto_equivalent_cpu_optimizers(
    standin_deepspeed, torch_cls, expected_cls, adamw_mode
):
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    mapped = {}

    def via_accelerate(params):
        mapped["opt"] = map_pytorch_optim_to_deepspeed(torch_cls(params, lr=0.05, weight_decay=0.1))
        return mapped["opt"]

    got = _train(via_accelerate)
    assert type(mapped["opt"]) is expected_cls
    if adamw_mode is not None:
        assert mapped["opt"].defaults["adamw_mode"] is adamw_mode
    _assert_same(got, _train(lambda p: torch_cls(p, lr=0.05, weight_decay=0.1)))


def test_zerotrain_offloaded_stage2_with_cpu_adam_matches_torch_adamw():
    model = _model()
    client = DeepSpeedCPUAdam(model.parameters(), lr=0.05, weight_decay=0.1, adamw_mode=True)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, opt, _, _ = zerotrain.initialize(model=model, optimizer=client, config=config)
    assert type(opt.optimizer) is DeepSpeedCPUAdam
    assert opt.optimizer.defaults["adamw_mode"] is True and opt.param_groups[0]["bias_correction"] is True

    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(STEPS):
        x, y = _batch(s)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
