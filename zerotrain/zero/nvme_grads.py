"""NvmeGradOffload: reduced gradient shards parked on NVMe between micro-steps (stages 2-3).

With the optimizer state on NVMe, keeping every bucket's gradient shard in host memory
would still make the process grow with the model (Ψ/N elements). Instead each bucket's
reduced shard is written to the optimizer's NvmeStore as soon as its reduce-scatter
completes. A later micro-step reads it back (the read starts when the bucket's
reduce-scatter is launched, so it overlaps the communication), adds, and writes again;
the first one after a step overwrites without reading.

The step needs every shard twice: all of them for the fp16 overflow check and the global
norm, then one sub-group at a time for the update. So when a bucket's final gradient of
the step is produced (the boundary micro-step), its norm and non-finite flag are taken
while it is in memory; the step combines those partial results and reads each gradient
once, with its sub-group. A gradient is never written after the step: it is dropped.
"""

from __future__ import annotations

import torch

from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.nvme_store import NvmeStore


class NvmeGradOffload:
    """Parks each FlatParam's `grad_shard` in a NvmeStore; keeps per-bucket norms for the step."""

    def __init__(self, store: NvmeStore, flat_params: list[FlatParam]) -> None:
        self.store = store
        self.flat_params = flat_params
        self._key = {id(fp): f"{i}.reduced_grad" for i, fp in enumerate(flat_params)}
        self._held: set[int] = set()  # buckets whose file holds a gradient of this step
        self._norm: dict[int, torch.Tensor] = {}  # final gradient's L2 norm, per bucket
        self._nonfinite: dict[int, torch.Tensor] = {}
        for fp in flat_params:
            # The shard lives with the master (host memory); its storage exists only while in use.
            grad = torch.empty(fp.shard_size, dtype=fp.data.dtype, device=fp.master.device)
            grad.untyped_storage().resize_(0)
            fp.grad_shard = grad

    # --- during backward (GradReducer) ---------------------------------------------------

    def prefetch(self, fp: FlatParam) -> None:
        """Starts reading the gradient accumulated so far, if any, before the next one arrives."""
        if id(fp) in self._held:
            self.store.swap_in(self._key[id(fp)], fp.grad_shard, async_op=True)

    def accumulate(self, fp: FlatParam, reduced: torch.Tensor, final: bool) -> None:
        """Adds a reduced gradient shard to the bucket's, parks it; `final`: the step's last one."""
        i, grad = id(fp), fp.grad_shard
        if i in self._held:
            self.store.swap_in(self._key[i], grad)  # waits for the read prefetch() started
            grad.add_(reduced.to(grad.device))
        else:
            self.store.allocate(self._key[i], grad)
            grad.copy_(reduced)
            self._held.add(i)
        if final:
            # The step's fp32 view of the gradient, as ZeroOptimizer would take it.
            g = grad.float()
            self._norm[i] = torch.linalg.vector_norm(g)
            self._nonfinite[i] = (~torch.isfinite(g)).any()
        self.store.swap_out(self._key[i], grad)

    # --- the step (ZeroOptimizer) --------------------------------------------------------

    def partials(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(any non-finite element, sum of squares) over this rank's gradient shards."""
        for fp in self.flat_params:
            if id(fp) not in self._norm:
                self._measure(fp)  # no final gradient recorded (not produced at a boundary): read it
        norms = [self._norm[id(fp)] for fp in self.flat_params]
        flags = [self._nonfinite[id(fp)] for fp in self.flat_params]
        if not norms:
            return torch.zeros(()), torch.zeros(())
        return torch.stack(flags).any().float(), torch.stack(norms).square().sum()

    def swap_in(self, fps: list[FlatParam], async_op: bool = False) -> None:
        """Brings the gradients of `fps` in (zeros where none was produced)."""
        for fp in fps:
            if id(fp) in self._held:
                self.store.swap_in(self._key[id(fp)], fp.grad_shard, async_op=async_op)
            else:
                self.store.allocate(self._key[id(fp)], fp.grad_shard)
                fp.grad_shard.zero_()
                self._held.add(id(fp))

    def wait(self, fps: list[FlatParam]) -> None:
        for fp in fps:
            self.store.wait(self._key[id(fp)])

    def drop(self, fps: list[FlatParam]) -> None:
        """Releases the gradients of `fps` without writing them: the step has used them."""
        for fp in fps:
            if id(fp) in self._held:
                self.store.discard(self._key[id(fp)], fp.grad_shard)
                self._held.discard(id(fp))

    def zero_grad(self) -> None:
        """Forgets every gradient: the next micro-step starts from zeros (no read)."""
        self.drop([fp for fp in self.flat_params if id(fp) in self._held])
        self._norm.clear()
        self._nonfinite.clear()

    def _measure(self, fp: FlatParam) -> None:
        self.swap_in([fp])
        g = fp.grad_shard.float()
        self._norm[id(fp)] = torch.linalg.vector_norm(g)
        self._nonfinite[id(fp)] = (~torch.isfinite(g)).any()
        self.store.swap_out(self._key[id(fp)], fp.grad_shard)
