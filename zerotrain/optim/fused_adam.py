"""FusedAdam: DeepSpeed's GPU Adam(W) class, by its constructor, on torch's Adam.

DeepSpeed's FusedAdam is a CUDA kernel its scripts import by name (DeepSpeed-Chat picks
`DeepSpeedCPUAdam if args.offload else FusedAdam`). Here it is the same torch Adam(W) step as
`DeepSpeedCPUAdam`, on any device; `adam_w_mode` chooses decoupled weight decay (AdamW, the
default) or L2 (Adam). `set_grad_none` is DeepSpeed's and changes nothing: the engine clears
gradients itself.
"""

from __future__ import annotations

from zerotrain.optim.cpu_optimizers import DeepSpeedCPUAdam, Params


class FusedAdam(DeepSpeedCPUAdam):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam` (see the module docstring)."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adam_w_mode)
        # Kept under the constructor's own names, so the engine rebuilds it over master shards alike.
        self.defaults.update(adam_w_mode=adam_w_mode, set_grad_none=set_grad_none)
