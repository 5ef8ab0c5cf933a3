"""`deepspeed.zero`: zerotrain's ZeRO context managers."""

from deepspeed.runtime.zero import *  # noqa: F401,F403
from deepspeed.runtime.zero import __all__  # noqa: F401
