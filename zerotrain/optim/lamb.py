"""LAMB (layer-wise adaptive moments), with the update rule of DeepSpeed's FusedLamb.

Per parameter tensor, every step:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)      (bias_correction=True)
    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * p     (eps_inside_sqrt: sqrt(v_hat + eps))
    ratio = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 when either norm is 0
    p -= lr * ratio * update

The trust ratio is taken over each tensor the optimizer holds. Under ZeRO those are the rank's
flat shards, exactly as in DeepSpeed, which also runs FusedLamb on its flattened partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class Lamb(Optimizer):
    """LAMB optimizer (https://arxiv.org/abs/1904.00962), DeepSpeed FusedLamb semantics.

    Args:
        params: parameters or torch-style parameter groups.
        lr: learning rate.
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator (outside the square root unless ``eps_inside_sqrt``).
        weight_decay: coefficient of the decoupled ``weight_decay * p`` term added to the update
            before the trust ratio is computed.
        bias_correction: divide the moments by ``1 - beta**t``.
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` as the denominator.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        amsgrad: not supported; accepted so DeepSpeed configs that spell it out as false load.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant (amsgrad=True)")
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._last_trust_ratios: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last step, one per updated tensor (as DeepSpeed reports)."""
        return [float(r) for r in self._last_trust_ratios]

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._last_trust_ratios = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                ratio = self._update_one(p, p.grad, state, group, beta1, beta2, lr)
                self._last_trust_ratios.append(ratio)
        return loss

    @staticmethod
    def _update_one(
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        beta1: float,
        beta2: float,
        lr: float,
    ) -> torch.Tensor:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

        if group["bias_correction"]:
            step = state["step"]
            correction1 = 1.0 - beta1**step
            correction2 = 1.0 - beta2**step
        else:
            correction1 = correction2 = 1.0
        v_hat = exp_avg_sq / correction2
        if group["eps_inside_sqrt"]:
            denom = v_hat.add_(group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt_().add_(group["eps"])
        update = (exp_avg / correction1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])

        # Kept as tensors so the step never waits on the device for the norms.
        weight_norm = torch.linalg.vector_norm(p.float())
        update_norm = torch.linalg.vector_norm(update.float())
        clamped = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((weight_norm > 0) & (update_norm > 0), clamped, torch.ones_like(clamped))
        p.add_(update * ratio.to(update.dtype), alpha=-lr)
        return ratio
