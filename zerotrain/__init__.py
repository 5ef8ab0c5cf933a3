"""zerotrain: ZeRO distributed training for PyTorch, DeepSpeed-compatible."""

from typing import TYPE_CHECKING

from zerotrain.config.lazy_exports import export_lazily

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from zerotrain import zero
    from zerotrain.compat.comm import init_distributed
    from zerotrain.compat.initialize import add_config_arguments, initialize

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "__version__"]

# `import zerotrain` stays light (no torch), so the `zerotrain` command starts in well under a
# second; DeepSpeed's entry points are imported on first use: `zerotrain.initialize(...)`,
# `from zerotrain import initialize`, `import zerotrain as deepspeed; deepspeed.zero.Init(...)`.
export_lazily(__name__, {
    "initialize": "zerotrain.compat.initialize",
    "add_config_arguments": "zerotrain.compat.initialize",
    "init_distributed": "zerotrain.compat.comm",  # DeepSpeed's signature (dist_backend=, timeout=, ...)
}, submodules=["zero"])
