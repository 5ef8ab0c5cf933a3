"""ZeRO internals; `GatheredParameters` and `Init` are the public pieces, as `deepspeed.zero`'s."""

from zerotrain.zero.gathered_parameters import GatheredParameters
from zerotrain.zero.init_context import Init

__all__ = ["GatheredParameters", "Init"]
