"""zerotrain: ZeRO distributed training for PyTorch, DeepSpeed-compatible."""

from zerotrain.api import add_config_arguments, initialize
from zerotrain.distributed import init_distributed

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "__version__"]
