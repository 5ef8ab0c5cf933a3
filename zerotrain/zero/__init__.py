"""ZeRO internals; the public pieces are `deepspeed.zero`'s: `GatheredParameters`, `Init`,
`register_external_parameter` and `unregister_external_parameter`."""

from zerotrain.zero.external_params import register_external_parameter, unregister_external_parameter
from zerotrain.zero.gathered_parameters import GatheredParameters
from zerotrain.zero.init_context import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
