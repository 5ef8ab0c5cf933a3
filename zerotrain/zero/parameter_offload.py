"""ParameterOffload: DeepSpeed's `optimizer.parameter_offload`, over zerotrain's ParamGatherer.

Tools that generate with a ZeRO-3 policy (TRL's `unwrap_model_for_generation`: GRPO, online DPO,
GKD) gather every parameter, take DeepSpeed's forward hooks off so that generation runs on the
whole weights without gathering or freeing, and put them back afterwards:

    with deepspeed.zero.GatheredParameters(model.parameters()):
        offload = engine.optimizer.parameter_offload
        for p in ...offload.module's parameters and offload.module.ds_external_parameters():
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks: hook.remove()
        ...generate...
        offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)

This object answers those names; the hooks are the gatherer's, re-installed as they were, and the
unit order is recorded again at the next forward.
"""

from __future__ import annotations

from torch import nn

from zerotrain.zero.external_params import external_parameters
from zerotrain.zero.param_gatherer import ParamGatherer


class _TraceCoordinator:
    """DeepSpeed's `param_coordinator`: only the trace calls tools make."""

    def __init__(self, gatherer: ParamGatherer) -> None:
        self._gatherer = gatherer

    def is_invalid_trace(self) -> bool:
        return not self._gatherer._recorded

    def _invalidate_trace(self) -> None:
        self._gatherer.forget_order()


class ParameterOffload:
    """`engine.optimizer.parameter_offload` at stage 3 (see the module docstring)."""

    def __init__(self, gatherer: ParamGatherer, module: nn.Module) -> None:
        self._gatherer = gatherer
        self.module = module
        self.forward_hooks = gatherer.hooks
        self.backward_hooks: list = []  # gradients arrive through tensor hooks made per forward
        self.param_coordinator = _TraceCoordinator(gatherer)
        module.ds_external_parameters = lambda: [
            (f"external_{i}", p) for i, p in enumerate(p for m in module.modules() for p in external_parameters(m))
        ]

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Puts the gatherer's hooks back (`module` is the model they were taken from)."""
        if module is not self.module:
            raise ValueError("parameter_offload._register_deepspeed_module: not the module this engine trains")
        self.forward_hooks = list(self._gatherer.install_hooks())
