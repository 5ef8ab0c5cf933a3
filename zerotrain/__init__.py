"""zerotrain: ZeRO distributed training for PyTorch, DeepSpeed-compatible."""

from typing import Any

from zerotrain.compat.initialize import add_config_arguments, initialize
from zerotrain.compat.comm import init_distributed  # DeepSpeed's signature (dist_backend=, timeout=, ...)

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "__version__"]


def __getattr__(name: str) -> Any:
    # `import zerotrain as deepspeed; deepspeed.zero.Init(...)` works as with DeepSpeed, while a
    # plain `import zerotrain` stays light: the ZeRO machinery is imported on first use.
    if name == "zero":
        import importlib

        return importlib.import_module("zerotrain.zero")
    raise AttributeError(f"module 'zerotrain' has no attribute {name!r}")
