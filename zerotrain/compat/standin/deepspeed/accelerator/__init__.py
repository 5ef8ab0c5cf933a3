"""`deepspeed.accelerator.get_accelerator()` (zerotrain/compat/accelerator.py)."""

from zerotrain.compat.accelerator import get_accelerator

__all__ = ["get_accelerator"]
