"""ZeroOptimizer: fp32 master shards, the wrapped torch optimizer, and the boundary step.

At the accumulation boundary, with every gradient already reduced into the
rank's shard: unscale, check for fp16 overflow across ranks, take the global
gradient norm across all shards, clip, step the torch optimizer on the master
shards, copy them back into the low-precision parameters, and all-gather the
updated parameters (sharded stages) in `allgather_bucket_size` buckets.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from zerotrain.comm import distributed as zdist
from zerotrain.zero.flat_param import FlatParam


class ZeroOptimizer:
    """Presents the torch optimizer built over master shards as the engine's optimizer.

    `param_groups` and `state` are those of the inner torch optimizer, so LR
    schedulers (DeepSpeed's or torch's) drive it directly.
    """

    def __init__(
        self,
        flat_params: list[FlatParam],
        group_options: list[dict],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        stage: int,
        clip: float,
        loss_scaler=None,
        allgather_bucket_size: int = 500_000_000,
        sub_group_size: int = 1_000_000_000,
        nvme=None,
        nvme_grads=None,
    ) -> None:
        self.flat_params = flat_params
        self.comm_device = flat_params[0].data.device if flat_params else torch.device("cpu")
        self.stage = stage
        # Ranks hold different shards only at stages >= 1 with more than one rank.
        self.sharded = stage >= 1 and dist.is_initialized() and dist.get_world_size() > 1
        self.clip = clip
        self.loss_scaler = loss_scaler
        self.allgather_bucket_size = allgather_bucket_size
        self.sub_group_size = sub_group_size
        groups = []
        for g, options in enumerate(group_options):
            masters = [fp.master for fp in flat_params if fp.group_index == g]
            if masters:
                groups.append({**options, "params": masters})
        self.optimizer = make_optimizer(groups)
        self.nvme = nvme  # NvmeOptimizerOffload: state parked on disk between steps
        if nvme is not None:
            nvme.attach(self.optimizer)
        self.nvme_grads = nvme_grads  # NvmeGradOffload: gradient shards parked between micro-steps
        self.last_grad_norm: float | None = None
        self.overflow = False  # the last step was skipped for fp16 overflow (DeepSpeed's attribute)

    # torch.optim.Optimizer look-alike -------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 without one), under DeepSpeed's name."""
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every gradient buffer (the engine calls this after each step)."""
        for fp in self.flat_params:
            fp.master.grad = None
            if fp.grad_full is not None:
                fp.clear_grad_full()  # no memset: the next gradients overwrite it (FlatParam.add_grad)
            if self.stage == 1:
                fp.grad_shard = None  # stage 1 keeps whole gradients; the shard lives only in the step
            elif fp.grad_shard is not None and self.nvme_grads is None:
                fp.grad_shard.zero_()
        if self.nvme_grads is not None:
            self.nvme_grads.zero_grad()  # parked shards: forgotten, not zeroed on disk

    # the step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Takes one optimizer step on the reduced gradients. Returns False if fp16 overflowed."""
        parked = self.nvme_grads is not None
        # The checks read the gradients as they are (bf16/fp16 summed in fp32; parked ones through
        # per-bucket partials). The fp32 copies the step needs are made a sub-group at a time
        # below: made all at once, an offloaded optimizer's host peak grew by 4 bytes per element.
        if parked:
            nonfinite, sum_sq = self.nvme_grads.partials()
        else:
            nonfinite, sum_sq = self._local_partials([fp.grad_of_shard() for fp in self.flat_params],
                                                     check_finite=self.loss_scaler is not None)
        scale = self.cur_scale
        self.overflow = self.loss_scaler is not None and self._overflowed(nonfinite)
        if self.overflow:
            self.loss_scaler.update_scale(True)
            self.last_grad_norm = float("inf")
            self.zero_grad()
            return False
        norm = self._global_norm(sum_sq) / scale
        self.last_grad_norm = norm
        factor = 1.0 / scale
        if self.clip > 0:
            # torch.nn.utils.clip_grad_norm_'s coefficient, clamped to 1.
            factor *= min(self.clip / (norm + 1e-6), 1.0)
        for fp in self.flat_params:
            fp.free()  # stage 3: a whole copy still up from backward (prefetch, reuse) would go stale
        sub_groups = self._sub_groups()
        for n, sub_group in enumerate(sub_groups):
            # Step a sub-group at a time: torch optimizers skip parameters without a gradient,
            # so the temporaries of a (CPU) step stay within sub_group_size elements.
            self._swap_in(sub_group, sub_groups[n + 1] if n + 1 < len(sub_groups) else None)
            sub_grads = [self._master_grad(fp) for fp in sub_group]
            if factor != 1.0:
                torch._foreach_mul_(sub_grads, factor)
            for fp, g in zip(sub_group, sub_grads):
                fp.master.grad = g
            self.optimizer.step()
            for fp in sub_group:
                fp.master.grad = None
                fp.copy_master_to_shard()
            if parked:
                self.nvme_grads.drop(sub_group)
            if self.nvme is not None:
                self.nvme.swap_out(sub_group)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()
        self.all_gather_params()
        return True

    def _swap_in(self, sub_group: list[FlatParam], next_group: list[FlatParam] | None) -> None:
        """Brings a sub-group's NVMe-parked state (and gradients) in, reading the next one ahead."""
        for swap in (self.nvme, self.nvme_grads):
            if swap is not None:
                swap.swap_in(sub_group)
                if next_group is not None:
                    swap.swap_in(next_group, async_op=True)  # read ahead while this one steps
                swap.wait(sub_group)

    def _sub_groups(self) -> list[list[FlatParam]]:
        """Consecutive buckets of at most `sub_group_size` elements of master shard (one at least)."""
        sizes = [fp.master.numel() for fp in self.flat_params]
        groups, start = [], 0
        for count in sub_group_counts(sizes, self.sub_group_size):
            groups.append(self.flat_params[start : start + count])
            start += count
        return groups or [[]]

    def _master_grad(self, fp: FlatParam) -> torch.Tensor:
        """The shard's gradient where the master lives, in fp32 (a copy only when needed)."""
        return fp.grad_of_shard().to(device=fp.master.device, dtype=torch.float32)

    @staticmethod
    def _local_partials(grads: list[torch.Tensor], check_finite: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(any non-finite element, if asked; sum of squares) over this rank's gradient shards."""
        if not grads:
            return torch.zeros(()), torch.zeros(())
        nonfinite = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float() if check_finite else None
        # Norms summed in fp32 whatever the gradients' dtype, with no squared copy of a bucket.
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        return nonfinite, torch.stack(norms).square().sum()

    def _overflowed(self, nonfinite: torch.Tensor) -> bool:
        local = nonfinite.to(self.comm_device)
        if self.sharded:
            zdist.all_reduce(local, "scalar", op=dist.ReduceOp.MAX)
        return bool(local.item())

    def _global_norm(self, sum_sq: torch.Tensor) -> float:
        """L2 norm of the whole gradient: each rank sums squares over its shard only."""
        sq = sum_sq.to(self.comm_device)  # offloaded grads are on the CPU; NCCL reduces device tensors
        if self.sharded:
            zdist.all_reduce(sq, "scalar")
        return float(sq.sqrt())

    def all_gather_params(self) -> None:
        """Rebuilds whole parameters from every rank's updated shard, bucket by bucket (stages 1-2).

        Stage 3 gathers each unit when it is next used instead, except persistent buckets.
        """
        if not self.sharded:
            return
        bucket: list[FlatParam] = []
        size = 0
        for fp in self.flat_params:
            if fp.local_shard is not None:
                continue  # a stage-3 bucket: gathered on its next use
            if bucket and size + fp.padded_numel > self.allgather_bucket_size:
                self._gather_bucket(bucket)
                bucket, size = [], 0
            bucket.append(fp)
            size += fp.padded_numel
        if bucket:
            self._gather_bucket(bucket)

    def _gather_bucket(self, bucket: list[FlatParam]) -> None:
        if len(bucket) == 1:
            fp = bucket[0]
            # In place, the input being the output's own slice: NCCL documents this use, and Gloo
            # reads the input into its own buffer before it writes the output. No copy of the shard.
            zdist.all_gather(fp.data, fp.shard(), "param")
            return
        send = torch.cat([fp.shard() for fp in bucket])
        world = bucket[0].padded_numel // bucket[0].shard_size
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        zdist.all_gather(recv, send, "param")
        rows = recv.view(world, send.numel())
        off = 0
        for fp in bucket:
            fp.data.view(world, fp.shard_size).copy_(rows[:, off : off + fp.shard_size])
            off += fp.shard_size

    # accounting -------------------------------------------------------------------------

    def states_resident(self):
        """Context in which every master shard and optimizer state is in memory (NVMe offload)."""
        return self.nvme.resident() if self.nvme is not None else contextlib.nullcontext()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, measured from the tensors themselves.

        `optimizer_state` counts per-element state (exp_avg, ...); scalar state such
        as Adam's step counter is reported separately as `optimizer_scalars`.
        """
        out = {"params": 0, "grads": 0, "master": 0, "optimizer_state": 0, "optimizer_scalars": 0}
        for fp in self.flat_params:
            out["params"] += fp.data.untyped_storage().nbytes()  # 0 while a stage-3 unit is freed
            if fp.local_shard is not None:
                out["params"] += fp.local_shard.untyped_storage().nbytes()  # 0 while parked on NVMe
            shard_own = fp.sharded and not fp.grad_shard_is_view_of_full  # a view holds no memory
            for g in (fp.grad_full, fp.grad_shard if shard_own else None):
                if g is not None:
                    out["grads"] += g.untyped_storage().nbytes()
            if not fp.master_is_param:
                out["master"] += fp.master.untyped_storage().nbytes()  # 0 while parked on NVMe
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    key = "optimizer_state" if v.numel() > 1 else "optimizer_scalars"
                    out[key] += v.untyped_storage().nbytes()
        return out


def sub_group_counts(sizes: list[int], limit: int) -> list[int]:
    """How many consecutive buckets (of `sizes` elements) each optimizer sub-group takes: as many as
    fit in `limit` elements, one at least. The planner sizes the step's temporaries by it too."""
    counts: list[int] = []
    total = 0
    for size in sizes:
        if counts and total + size <= limit:
            counts[-1] += 1
            total += size
        else:
            counts.append(1)
            total = size
    return counts
