"""NvmeOptimizerOffload: fp32 master shards and optimizer state kept on NVMe between steps.

Each master is parked as soon as it is made, while the model is bucketed. The step
brings one sub-group (`sub_group_size` elements) into memory at a time,
prefetching the next while the current one steps, and parks it again after, so
host memory holds about two sub-groups of optimizer state instead of all of it.
Gradient shards are parked in the same store by NvmeGradOffload (`nvme_grads.py`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.nvme_store import NvmeStore


class NvmeOptimizerOffload:
    """Swaps each bucket's master shard and per-element optimizer state in and out of a NvmeStore."""

    def __init__(self, store: NvmeStore) -> None:
        self.store = store
        self.flat_params: list[FlatParam] = []
        self._index: dict[int, int] = {}
        self._known: set[str] = set()  # keys with a file (swapped out at least once)
        self.optimizer: torch.optim.Optimizer | None = None

    def adopt(self, fp: FlatParam) -> None:
        """Parks `fp`'s new master shard (while the model is bucketed: one bucket's master in memory at a time)."""
        if fp.master_is_param:
            # The master is parked on disk between steps; the parameters must not be.
            fp.master = fp.master.detach().clone()
            fp.master_is_param = False
        fp.master_swap = self  # lets FlatParam.set_shard reach a parked master
        self._index[id(fp)] = len(self.flat_params)
        self.flat_params.append(fp)
        self.swap_out([fp])

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Starts managing the optimizer's state (made over the parked master shards)."""
        self.optimizer = optimizer

    def _tensors(self, fp: FlatParam) -> list[tuple[str, torch.Tensor]]:
        i = self._index[id(fp)]
        out = [(f"{i}.master", fp.master)]
        state = self.optimizer.state.get(fp.master, {}) if self.optimizer is not None else {}
        out += [(f"{i}.{k}", v) for k, v in state.items() if torch.is_tensor(v) and v.numel() == fp.master.numel()]
        return out

    def swap_in(self, fps: list[FlatParam], async_op: bool = False) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                if key in self._known:  # else state the optimizer just made: in memory only
                    # Also when t still has its bytes: a write of it may be pending, and the
                    # store must keep them rather than release them when the write ends.
                    self.store.swap_in(key, t, async_op=async_op)

    def wait(self, fps: list[FlatParam]) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                if key in self._known:
                    self.store.wait(key)

    def swap_out(self, fps: list[FlatParam]) -> None:
        for fp in fps:
            for key, t in self._tensors(fp):
                self.store.swap_out(key, t)
                self._known.add(key)

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
