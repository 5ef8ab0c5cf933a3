"""NvmeOptimizerOffload: fp32 master shards and optimizer state kept on NVMe between steps.

The step brings one sub-group (`sub_group_size` elements) into memory at a time,
prefetching the next while the current one steps, and parks it again after, so
host memory holds about two sub-groups of optimizer state instead of all of it.
Gradient shards stay in (host) memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.nvme_store import NvmeStore


class NvmeOptimizerOffload:
    """Swaps each bucket's master shard and per-element optimizer state in and out of a NvmeStore."""

    def __init__(self, store: NvmeStore, flat_params: list[FlatParam]) -> None:
        self.store = store
        self.flat_params = flat_params
        self._index = {id(fp): i for i, fp in enumerate(flat_params)}
        self.optimizer: torch.optim.Optimizer | None = None
        for fp in flat_params:
            if fp.master_is_param:
                # The master is parked on disk between steps; the parameters must not be.
                fp.master = fp.master.detach().clone()
                fp.master_is_param = False

    @staticmethod
    def bytes_needed(flat_params: list[FlatParam], state_per_element: int = 8) -> int:
        """Disk the state will take: fp32 master plus (by default) Adam's two fp32 moments."""
        return sum(fp.shard_size * (4 + state_per_element) for fp in flat_params)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Starts managing the optimizer's state and parks every master shard."""
        self.optimizer = optimizer
        self.swap_out(self.flat_params)

    def _tensors(self, fp: FlatParam) -> list[tuple[str, torch.Tensor]]:
        i = self._index[id(fp)]
        out = [(f"{i}.master", fp.master)]
        state = self.optimizer.state.get(fp.master, {}) if self.optimizer is not None else {}
        out += [(f"{i}.{k}", v) for k, v in state.items() if torch.is_tensor(v) and v.numel() == fp.master.numel()]
        return out

    def swap_in(self, fps: list[FlatParam], async_op: bool = False) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                if t.untyped_storage().nbytes() == 0:
                    self.store.swap_in(key, t, async_op=async_op)

    def wait(self, fps: list[FlatParam]) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                self.store.wait(key)

    def swap_out(self, fps: list[FlatParam]) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                self.store.swap_out(key, t)

    @contextlib.contextmanager
    def resident(self, fps: list[FlatParam] | None = None) -> Iterator[None]:
        """Everything (or `fps`) in memory for the block: checkpoints, GatheredParameters."""
        fps = self.flat_params if fps is None else fps
        self.swap_in(fps)
        self.wait(fps)
        try:
            yield
        finally:
            self.swap_out(fps)
