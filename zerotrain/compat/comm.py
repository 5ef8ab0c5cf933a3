"""`deepspeed.comm`: process-group calls, on torch.distributed.

Only `init_distributed` does more than forward: it starts zerotrain's default group (NCCL on
GPUs, Gloo on CPUs) from whatever launcher set the environment, unless one exists, and tells
Accelerate the group's backend (see `_tell_accelerate_the_backend`).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from zerotrain.comm import distributed as zdist


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Starts the default process group once (DeepSpeed's signature; the backend is zerotrain's choice).

    `distributed_port` is used when no MASTER_PORT is set; `timeout` defaults to 30 minutes.
    """
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("dist_init_required=False, but torch.distributed is not initialized")
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    zdist.init_distributed(timeout.total_seconds() if timeout is not None else 1800.0)
    _tell_accelerate_the_backend(dist.get_backend())


def _tell_accelerate_the_backend(backend: str) -> None:
    # Accelerate's PartialState, on a machine without GPUs, asks deepspeed.comm to start the
    # group but records its own backend as None, and then believes it is process 0 of 1 on
    # every rank. It is in the middle of its __init__ (it called us); its state is a shared
    # dict (the Borg pattern), so setting the backend there makes it read the real world size.
    state_module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state_module, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and "backend" in shared and shared["backend"] is None:
        shared["backend"] = backend


def is_initialized() -> bool:
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        # Accelerate asks this first and calls init_distributed only when it is False: a group the
        # script started itself (Axolotl) must reach Accelerate's state here.
        _tell_accelerate_the_backend(dist.get_backend())
    return initialized


def get_rank(group=None) -> int:
    """This process's rank (the launcher's RANK before the group is started)."""
    if is_initialized():
        return dist.get_rank(group)
    return zdist.read_launch_env().rank


def get_world_size(group=None) -> int:
    if is_initialized():
        return dist.get_world_size(group)
    return zdist.read_launch_env().world_size


def get_local_rank() -> int:
    return zdist.read_launch_env().local_rank


def __getattr__(name: str) -> Any:
    # barrier, all_reduce, broadcast, all_gather, new_group, ReduceOp, ...: torch's own.
    try:
        return getattr(dist, name)
    except AttributeError:
        raise AttributeError(f"deepspeed.comm (zerotrain) has no attribute {name!r}") from None
