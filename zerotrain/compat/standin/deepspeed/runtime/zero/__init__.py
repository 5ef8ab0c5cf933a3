"""`deepspeed.runtime.zero` (also `deepspeed.zero`)."""

from zerotrain.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
