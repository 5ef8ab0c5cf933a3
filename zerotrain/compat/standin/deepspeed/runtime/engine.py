"""`deepspeed.runtime.engine.DeepSpeedEngine` is zerotrain's Engine."""

from zerotrain.runtime.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
