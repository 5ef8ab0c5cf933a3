"""`deepspeed.comm`, on torch.distributed (zerotrain/compat/comm.py)."""

from zerotrain.compat.comm import *  # noqa: F401,F403
from zerotrain.compat.comm import __getattr__, get_local_rank, get_rank, get_world_size, init_distributed, is_initialized  # noqa: F401
