"""Pure-torch stand-ins for DeepSpeed's CPU optimizers (`deepspeed.ops.{adam,adagrad,lion}`).

Accelerate swaps a user's torch optimizer for one of these whenever the optimizer is
offloaded (`map_pytorch_optim_to_deepspeed`), passing the old optimizer's `param_groups`
plus `lr`, `weight_decay` and `adamw_mode`. They take DeepSpeed's constructor
arguments and follow its update rules, but run on torch's own optimizers: nothing compiled.

Every constructor argument is kept in `defaults`, so zerotrain's engine can rebuild the
optimizer over its master shards as `type(opt)(groups, **defaults)`.

`fp32_optimizer_states` is accepted and recorded, but the states take the parameter's
dtype, as in torch; zerotrain steps fp32 master weights, so they are fp32 there.

Accelerate's mapping passes `adamw_mode` to whichever class it picks, though only DeepSpeed's
Adam takes it (with real DeepSpeed, a torch Adagrad under an offloaded optimizer dies with a
TypeError). The Adagrad and Lion here accept the flag and ignore it, so that path works; it is
not stored in `defaults`, so a rebuild never passes it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerotrain.optim.lion import Lion

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam / AdamW with DeepSpeed's `DeepSpeedCPUAdam` arguments.

    Args:
        model_params: parameters or torch-style parameter groups.
        lr, betas, eps, weight_decay: as in torch's Adam.
        bias_correction: False drops Adam's bias correction: ``p -= lr * m / (sqrt(v) + eps)``.
        amsgrad: must stay False; DeepSpeed's CPU Adam has no AMSGrad either.
        adamw_mode: True decays weights decoupled from the gradient (torch's AdamW);
            False adds ``weight_decay * p`` to the gradient (L2, torch's Adam). It applies to
            every group, whatever decay style a group carried over from another optimizer.
        fp32_optimizer_states: recorded only (see the module docstring).
    """

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant (amsgrad=True)")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
        extra = dict(
            bias_correction=bias_correction, adamw_mode=adamw_mode, fp32_optimizer_states=fp32_optimizer_states
        )
        self.defaults.update(extra)
        for group in self.param_groups:
            for key in ("bias_correction", "fp32_optimizer_states"):
                group.setdefault(key, extra[key])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Groups handed over from a torch optimizer carry its amsgrad flag.
        if param_group.get("amsgrad", False):
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant (amsgrad=True)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Adam(W) update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw = self.defaults["adamw_mode"]
        torch_groups = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if adamw and group["weight_decay"] != 0 and params:
                # Decoupled decay never touches the moments, so shrinking p before the
                # undecayed Adam step is exactly torch's AdamW, on every torch version.
                torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            # What torch's step sees: the user's group is left as it is (schedulers read it).
            view = {**group, "decoupled_weight_decay": False}
            if adamw:
                view["weight_decay"] = 0.0
            if group.get("bias_correction", True):
                torch_groups.append(view)
            else:
                self._step_without_bias_correction(view, params)
        if torch_groups:
            all_groups, self.param_groups = self.param_groups, torch_groups
            try:
                super().step()
            finally:
                self.param_groups = all_groups
        return loss

    def _step_without_bias_correction(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        # torch's Adam has no switch for this; same state layout as torch, so checkpoints mix.
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grad = p.grad if group["weight_decay"] == 0 else p.grad.add(p, alpha=group["weight_decay"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad with DeepSpeed's `DeepSpeedCPUAdagrad` arguments: L2 weight decay, no lr decay.

    The sum of squared gradients starts at zero and the learning rate never decays, as in
    DeepSpeed's kernel, even when the groups came from a torch Adagrad with other settings.
    `amsgrad` is accepted and ignored, as DeepSpeed does; `fp32_optimizer_states` is recorded.
    `adamw_mode` is accepted and ignored: see the module docstring.
    """

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        adamw_mode: bool | None = None,
    ) -> None:
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)
        self.defaults.update(amsgrad=amsgrad, fp32_optimizer_states=fp32_optimizer_states)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # A copy: the group may still belong to the torch optimizer it came from.
        super().add_param_group({**param_group, "lr_decay": 0.0})


class DeepSpeedCPULion(Lion):
    """Lion with DeepSpeed's `DeepSpeedCPULion` arguments (decoupled weight decay).

    Unlike `Lion`, `betas` defaults to DeepSpeed's (0.9, 0.999); `fp32_optimizer_states` is recorded.
    `adamw_mode` is accepted and ignored: see the module docstring.
    """

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
        adamw_mode: bool | None = None,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.defaults["fp32_optimizer_states"] = fp32_optimizer_states
