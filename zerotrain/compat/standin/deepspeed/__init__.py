"""zerotrain's stand-in for DeepSpeed: `import deepspeed` under `zerotrain run` / `zerotrain launch`.

Every name here is zerotrain's own object (see zerotrain/deepspeed_standin.py).
"""

import sys

try:
    import zerotrain  # noqa: F401
except ModuleNotFoundError:
    raise ModuleNotFoundError(
        f"`import deepspeed` here is zerotrain's stand-in, but zerotrain is not installed for this Python "
        f"({sys.executable}): run the command with the Python zerotrain is installed in (activate its venv)"
    ) from None

from zerotrain import add_config_arguments, init_distributed, initialize
from zerotrain.compat.accelerator import get_accelerator  # DeepSpeed-Chat: `from deepspeed import get_accelerator`
from zerotrain.compat.deepspeed_standin import VERSION as __version__
from zerotrain.runtime.engine import Engine as DeepSpeedEngine
from zerotrain.compat.unsupported_features import tp_model_init

# DeepSpeed's own layout: these are attributes of `deepspeed` once it is imported.
from deepspeed import accelerator, checkpoint, checkpointing, comm, launcher, runtime, utils, zero  # noqa: E402,F401

__zerotrain_standin__ = True
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
__git_hash__ = None
__git_branch__ = None

__all__ = ["DeepSpeedEngine", "add_config_arguments", "comm", "get_accelerator", "init_distributed", "initialize",
           "tp_model_init", "zero"]
