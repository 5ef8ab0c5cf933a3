"""`deepspeed.runtime.engine.DeepSpeedEngine` is zerotrain's Engine."""

from zerotrain.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
