"""zerotrain: ZeRO distributed training for PyTorch, DeepSpeed-compatible."""

from zerotrain.api import initialize  # noqa: E402

__version__ = "0.1.0"
__all__ = ["initialize", "__version__"]
