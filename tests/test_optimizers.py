"""build_optimizer's DeepSpeed semantics, and the Lamb and Lion update rules."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.config.errors import ConfigError
from zerotrain.optim import Lamb, Lion, build_optimizer


def param(*values: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def one_group(*values: float) -> list[dict]:
    return [{"params": [param(*values)]}]


# --------------------------------------------------------------------------- build_optimizer


def test_adam_means_decoupled_weight_decay_by_default():
    opt = build_optimizer("Adam", {"lr": 1e-3}, one_group(1.0))
    assert type(opt) is torch.optim.AdamW
    # FusedAdam's defaults, not torch AdamW's weight_decay=0.01.
    assert opt.defaults["weight_decay"] == 0.0
    assert opt.defaults["foreach"] is True


def test_adam_w_mode_false_gives_l2_adam():
    opt = build_optimizer("Adam", {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}, one_group(1.0))
    assert type(opt) is torch.optim.Adam


def test_adamw_ignores_adam_w_mode_false():
    opt = build_optimizer("AdamW", {"lr": 1e-3, "adam_w_mode": False}, one_group(1.0))
    assert type(opt) is torch.optim.AdamW


def test_adam_modes_differ_numerically():
    # Same gradient, weight decay 0.5: L2 folds wd*p into the gradient (then normalised away
    # on the first step since the only entry is positive), AdamW shrinks p by lr*wd*p outright.
    common = {"lr": 0.1, "weight_decay": 0.5, "betas": [0.9, 0.999], "eps": 0.0}
    l2 = build_optimizer("Adam", {**common, "adam_w_mode": False}, one_group(2.0))
    decoupled = build_optimizer("Adam", common, one_group(2.0))
    for opt in (l2, decoupled):
        p = opt.param_groups[0]["params"][0]
        p.grad = torch.tensor([1.0], dtype=torch.float64)
        opt.step()
    assert l2.param_groups[0]["params"][0].item() == pytest.approx(2.0 - 0.1)
    assert decoupled.param_groups[0]["params"][0].item() == pytest.approx(2.0 * (1 - 0.1 * 0.5) - 0.1)
    assert l2.param_groups[0]["betas"] == (0.9, 0.999)


def test_type_name_is_case_insensitive():
    assert type(build_optimizer("adamw", {}, one_group(1.0))) is torch.optim.AdamW
    assert isinstance(build_optimizer("LAMB", {}, one_group(1.0)), Lamb)
    assert isinstance(build_optimizer("sgd", {"lr": 0.1}, one_group(1.0)), torch.optim.SGD)
    assert isinstance(build_optimizer("Adagrad", {"lr_decay": 0.1}, one_group(1.0)), torch.optim.Adagrad)


def test_deepspeed_only_keys_accepted():
    opt = build_optimizer(
        "Adam", {"lr": 1e-3, "torch_adam": True, "bias_correction": True, "set_grad_none": True}, one_group(1.0)
    )
    assert type(opt) is torch.optim.AdamW


def test_bias_correction_false_rejected():
    with pytest.raises(ConfigError, match="bias_correction"):
        build_optimizer("Adam", {"bias_correction": False}, one_group(1.0))


def test_fused_is_passed_through_instead_of_foreach():
    opt = build_optimizer("AdamW", {"fused": True}, one_group(1.0))
    assert opt.defaults["fused"] is True
    assert not opt.defaults["foreach"]


def test_param_groups_override_config_params():
    a, b = param(1.0), param(2.0)
    groups = [{"params": [a], "weight_decay": 0.0}, {"params": [b], "lr": 0.5}]
    opt = build_optimizer("AdamW", {"lr": 0.1, "weight_decay": 0.3}, groups)
    first, second = opt.param_groups
    assert (first["lr"], first["weight_decay"]) == (0.1, 0.0)
    assert (second["lr"], second["weight_decay"]) == (0.5, 0.3)


def test_plain_tensor_list_is_one_group():
    opt = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9}, [param(1.0), param(2.0)])
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 2


def test_unknown_key_names_key_optimizer_and_suggestion():
    with pytest.raises(ConfigError) as err:
        build_optimizer("AdamW", {"lr": 1e-3, "betaz": [0.9, 0.99]}, one_group(1.0))
    message = str(err.value)
    assert "'betaz'" in message and "AdamW" in message and "did you mean 'betas'" in message


def test_unknown_lamb_key_suggests_lamb_name():
    with pytest.raises(ConfigError, match="did you mean 'max_coeff'"):
        build_optimizer("Lamb", {"max_coef": 5.0}, one_group(1.0))


def test_unknown_type_lists_supported():
    with pytest.raises(ConfigError) as err:
        build_optimizer("Adamm", {}, one_group(1.0))
    message = str(err.value)
    assert "did you mean 'Adam'" in message
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion"):
        assert name in message


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer("Lamb", {"max_grad_norm": 1.0}, one_group(1.0))


def test_lion_betas_default_differs_between_class_and_config():
    assert Lion([param(1.0)]).defaults["betas"] == (0.9, 0.99)
    assert build_optimizer("Lion", {}, one_group(1.0)).defaults["betas"] == (0.9, 0.999)


# --------------------------------------------------------------------------- Lamb


def lamb_one_step(values, grad, **kw) -> tuple[torch.Tensor, Lamb]:
    p = param(*values)
    opt = Lamb([p], **kw)
    p.grad = torch.tensor(grad, dtype=torch.float64)
    opt.step()
    return p.detach(), opt


def test_lamb_trust_ratio_hand_computed():
    # Step 1 with bias correction: m_hat = g, v_hat = g^2, so with eps = 0 the Adam part of the
    # update is sign(g) = [1, -1]. ||p|| = 5, ||update|| = sqrt(2): ratio 5 / sqrt(2).
    p, opt = lamb_one_step([3.0, 4.0], [1.0, -2.0], lr=0.1, eps=0.0)
    ratio = 5 / math.sqrt(2)
    assert opt.get_lamb_coeffs() == pytest.approx([ratio])
    assert p.tolist() == pytest.approx([3.0 - 0.1 * ratio, 4.0 + 0.1 * ratio])


def test_lamb_weight_decay_enters_the_update_before_the_ratio():
    # update = [1, -1] + 0.5 * [3, 4] = [2.5, 1]; ||update|| = sqrt(7.25).
    p, opt = lamb_one_step([3.0, 4.0], [1.0, -2.0], lr=0.1, eps=0.0, weight_decay=0.5)
    ratio = 5 / math.sqrt(7.25)
    assert opt.get_lamb_coeffs() == pytest.approx([ratio])
    assert p.tolist() == pytest.approx([3.0 - 0.1 * ratio * 2.5, 4.0 - 0.1 * ratio * 1.0])


def test_lamb_ratio_clamped_and_one_for_zero_weights():
    _, opt = lamb_one_step([3.0, 4.0], [1.0, -2.0], lr=0.1, eps=0.0, max_coeff=1.0)
    assert opt.get_lamb_coeffs() == pytest.approx([1.0])
    _, opt = lamb_one_step([300.0, 400.0], [1.0, -2.0], lr=0.1, eps=0.0)
    assert opt.get_lamb_coeffs() == pytest.approx([10.0])  # 500 / sqrt(2) clamped to max_coeff
    p, opt = lamb_one_step([0.0, 0.0], [1.0, -2.0], lr=0.1, eps=0.0)
    assert opt.get_lamb_coeffs() == pytest.approx([1.0])
    assert p.tolist() == pytest.approx([-0.1, 0.1])


def test_lamb_second_step_uses_bias_corrected_moments():
    b1, b2, g1, g2 = 0.9, 0.999, 1.0, -3.0
    p = param(2.0)
    opt = Lamb([p], lr=0.1, betas=(b1, b2), eps=0.0, max_coeff=1.0, min_coeff=1.0)  # ratio pinned to 1
    for g in (g1, g2):
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    m = (1 - b1) * (b1 * g1 + g2)
    v = (1 - b2) * (b2 * g1**2 + g2**2)
    update = (m / (1 - b1**2)) / math.sqrt(v / (1 - b2**2))
    assert p.item() == pytest.approx(2.0 - 0.1 * 1.0 - 0.1 * update)


# --------------------------------------------------------------------------- Lion


def test_lion_two_steps_hand_computed():
    p = param(1.0, -2.0, 0.5)
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    # Step 1, m = 0: direction sign(0.1 * g) = [1, -1, 0]; decay factor 1 - 0.1 * 0.1 = 0.99.
    p.grad = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    opt.step()
    assert p.tolist() == pytest.approx([0.99 - 0.1, -1.98 + 0.1, 0.495])
    m1 = [0.01 * 0.5, 0.01 * -1.0, 0.0]
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx(m1)
    # Step 2: c = 0.9 * m1 + 0.1 * g2 = [0.0035, 0.041, 0.02]: all positive, although g2[0] < 0.
    g2 = [-0.01, 0.5, 0.2]
    p.grad = torch.tensor(g2, dtype=torch.float64)
    before = p.detach().clone().tolist()
    opt.step()
    assert p.tolist() == pytest.approx([x * 0.99 - 0.1 for x in before])
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.99 * m + 0.01 * g for m, g in zip(m1, g2)])


# --------------------------------------------------------------------------- convergence


@pytest.mark.parametrize(
    "type_name, params",
    [
        ("Adam", {"lr": 0.1}),
        ("Adam", {"lr": 0.1, "adam_w_mode": False}),
        ("AdamW", {"lr": 0.1, "weight_decay": 0.01}),
        ("SGD", {"lr": 0.1, "momentum": 0.9}),
        ("Adagrad", {"lr": 0.5}),
        ("Lamb", {"lr": 0.05}),
        ("Lion", {"lr": 0.02}),
    ],
)
def test_each_optimizer_reduces_a_quadratic(type_name, params):
    torch.manual_seed(0)
    target = torch.tensor([1.0, -2.0, 3.0])
    x = torch.nn.Parameter(torch.full((3,), 0.5))
    opt = build_optimizer(type_name, params, [{"params": [x]}])

    def loss() -> torch.Tensor:
        return ((x - target) ** 2).sum()

    start = loss().item()
    for _ in range(300):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
    assert loss().item() < 0.05 * start
