"""Lion (evolved sign momentum), with the update order of the paper and DeepSpeed's FusedLion.

Every step, per parameter:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

Only one moment buffer is kept, half of Adam's optimizer state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class Lion(Optimizer):
    """Lion optimizer (https://arxiv.org/abs/2302.06675).

    Args:
        params: parameters or torch-style parameter groups.
        lr: learning rate (Lion usually wants 3-10x less than AdamW).
        betas: ``beta1`` interpolates the sign direction, ``beta2`` is the momentum decay.
            The paper's default (0.9, 0.99) is used here; note that a DeepSpeed config without
            ``betas`` gets (0.9, 0.999), which `build_optimizer` reproduces.
        weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay`` before the update.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"betas must lie in [0, 1], got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Apply one Lion update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # _foreach kernels want one device and dtype per list.
            buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = defaultdict(
                lambda: [[], [], []]
            )
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params, grads, moments = buckets[(p.device, p.dtype)]
                params.append(p)
                grads.append(p.grad)
                moments.append(state["exp_avg"])
            for params, grads, moments in buckets.values():
                self._update_bucket(params, grads, moments, group)
        return loss

    @staticmethod
    def _update_bucket(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        moments: list[torch.Tensor],
        group: dict[str, Any],
    ) -> None:
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        direction = torch._foreach_mul(moments, beta1)
        torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
        torch._foreach_sign_(direction)
        torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_mul_(moments, beta2)
        torch._foreach_add_(moments, grads, alpha=1.0 - beta2)
