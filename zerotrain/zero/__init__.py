"""ZeRO internals; `zerotrain.zero.GatheredParameters` is the public piece, as `deepspeed.zero`'s."""

from zerotrain.zero.gathered_parameters import GatheredParameters

__all__ = ["GatheredParameters"]
