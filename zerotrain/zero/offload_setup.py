"""Offload construction from the config: where shards live, and the NVMe stores that park them.

`offload_plan` runs before the model is bucketed and makes the NVMe stores, so that
each bucket's parameter shard (stage 3) and fp32 master are parked as soon as they
exist: a rank never holds all of them at once, not even at start-up. The gradient
swapper (`nvme_state_offload`) needs the buckets, and nothing of its own in memory.

Each store checks, before anything is written, that its `nvme_path` exists, is a
writable directory and has room for what it will park: per element of the rank's
shards, the parameter in the compute dtype (`offload_param`), the fp32 master and
Adam's two moments, and at stages 2-3 the gradient in the compute dtype
(`offload_optimizer`). When both paths are on one file system the first store
checks for the two together.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.nvme_grads import NvmeGradOffload
from zerotrain.zero.nvme_offload import NvmeOptimizerOffload
from zerotrain.zero.nvme_params import NvmeParamOffload
from zerotrain.zero.nvme_store import NvmeStore
from zerotrain.zero.stage import OffloadPlan

log = logging.getLogger("zerotrain")

# fp32 master (4) + Adam's exp_avg and exp_avg_sq (8), per shard element.
_OPTIMIZER_BYTES_PER_ELEMENT = 12


@dataclass(frozen=True)
class NvmeStateOffload:
    """The NVMe swappers of the optimizer's side of a bucket (None: not on NVMe)."""

    optimizer: NvmeOptimizerOffload | None = None  # fp32 master + optimizer state
    grads: NvmeGradOffload | None = None  # reduced gradient shards (stages 2-3)


def offload_plan(
    zero, trainable: list[list[nn.Parameter]], world: int, rank: int, compute_dtype: torch.dtype
) -> OffloadPlan:
    """Where offloaded shards live, from `offload_optimizer` / `offload_param` (cpu or nvme).

    NVMe offload keeps the state in host memory while it is in use, so it lives on the CPU too.
    """
    opt = zero.offload_optimizer if zero.offload_optimizer and zero.offload_optimizer.device != "none" else None
    par = zero.offload_param if zero.offload_param and zero.offload_param.device != "none" else None
    if opt and zero.stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (it offloads the optimizer's shard); "
            "set zero_optimization.stage"
        )
    if par and zero.stage != 3:
        # DeepSpeed reads offload_param at stage 3 only, and scripts write it at every stage
        # (DeepSpeed-Chat's --offload): accepted as DeepSpeed accepts it, and said.
        if rank == 0:
            log.warning(
                "zero_optimization.offload_param has no effect at ZeRO stage %d (as in DeepSpeed): parameters "
                "stay whole on the device; only stage 3 offloads them", zero.stage)
        par = None
    # Stage 1 keeps whole gradients by design; from stage 2 on, only shards exist to park.
    grads_parked = bool(opt and opt.device == "nvme" and zero.stage >= 2)
    # Upper bound of this rank's shard elements: buckets pad to a multiple of the world size.
    elements = sum(math.ceil(p.numel() / world) + 1 for group in trainable for p in group)
    element_size = torch.empty(0, dtype=compute_dtype).element_size()
    param_bytes = elements * element_size if par and par.device == "nvme" else 0
    state_bytes = elements * (_OPTIMIZER_BYTES_PER_ELEMENT + (element_size if grads_parked else 0))
    param_swap = state_swap = None
    if param_bytes:
        shared = opt is not None and opt.device == "nvme" and _same_file_system(par.nvme_path, opt.nvme_path)
        store = _store("offload_param", par, rank, param_bytes + (state_bytes if shared else 0))
        param_swap = NvmeParamOffload(store, par.max_in_cpu)
    if opt and opt.device == "nvme":
        state_swap = NvmeOptimizerOffload(_store("offload_optimizer", opt, rank, state_bytes))
    cpu = torch.device("cpu")
    return OffloadPlan(
        optimizer_device=cpu if opt else None,
        param_device=cpu if par else None,
        pin_memory=bool((opt and opt.pin_memory) or (par and par.pin_memory)),
        param_swap=param_swap,
        state_swap=state_swap,
        grads_parked=grads_parked,
    )


def nvme_state_offload(flat_params: list[FlatParam], plan: OffloadPlan) -> NvmeStateOffload:
    """The swappers of master, optimizer state and gradients when `offload_optimizer.device` is "nvme"."""
    if plan.state_swap is None:
        return NvmeStateOffload()
    grads = NvmeGradOffload(plan.state_swap.store, flat_params) if plan.grads_parked else None
    return NvmeStateOffload(plan.state_swap, grads)


def _store(section: str, offload, rank: int, needed_bytes: int) -> NvmeStore:
    if offload.nvme_path is None:
        raise ConfigError(f'zero_optimization.{section}.device is "nvme" but nvme_path is not set')
    return NvmeStore(offload.nvme_path, rank, needed_bytes=needed_bytes, max_in_flight=max(2, offload.buffer_count))


def _same_file_system(a, b) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False  # a missing path: its own store reports it
