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
        # The last step's gradient norm and fp16 overflow flag, kept on the device: read on request.
        self.grad_norm: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        # torch's fused Adam/AdamW skip a step on the device (found_inf) and unscale in the kernel.
        self.skips_on_device = device_can_skip(self.optimizer)

    # torch.optim.Optimizer look-alike -------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 without one), under DeepSpeed's name: a host read."""
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm (unscaled, unclipped; inf on fp16 overflow): a host read."""
        return float(self.grad_norm.item()) if self.grad_norm is not None else None

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped for fp16 overflow (DeepSpeed's attribute): a host read."""
        return self.found_inf is not None and bool(self.found_inf.item())

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

    def step(self) -> None:
        """Takes one optimizer step on the reduced gradients, with no host read of a tensor.

        The norm, the clip coefficient and the fp16 overflow flag stay on the device; with fp16,
        whether the step applied is `found_inf` (the loss scaler records it too: `take_event`),
        for the caller to read once the step has finished. With a torch fused Adam/AdamW the skip happens
        in the kernel (`found_inf`); any other optimizer cannot skip on the device, so an fp16 step
        reads the flag once on the host (`overflow`) to decide whether to call it.
        """
        parked = self.nvme_grads is not None
        # The checks read the gradients as they are (bf16/fp16 summed in fp32; parked ones through
        # per-bucket partials). The fp32 copies the step needs are made a sub-group at a time
        # below: made all at once, an offloaded optimizer's host peak grew by 4 bytes per element.
        if parked:
            nonfinite, sum_sq = self.nvme_grads.partials()
        else:
            nonfinite, sum_sq = self._local_partials([fp.grad_of_shard() for fp in self.flat_params],
                                                     check_finite=self.loss_scaler is not None)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        found_inf = self._found_inf(nonfinite) if scale is not None else None
        norm = self._global_norm(sum_sq)
        if scale is not None:
            norm = (norm / scale).masked_fill(found_inf != 0, float("inf"))  # DeepSpeed reports inf
        self.grad_norm, self.found_inf = norm, found_inf
        factor = scale.reciprocal() if scale is not None else None  # unscale and clip in one multiply
        if self.clip > 0:
            # torch.nn.utils.clip_grad_norm_'s coefficient, clamped to 1, as a device scalar.
            coef = (self.clip / (norm + 1e-6)).clamp(max=1.0)
            factor = coef if factor is None else factor * coef
        if found_inf is not None and not self.skips_on_device and self.overflow:  # one host read
            self._finish(found_inf, applied=False)
            return
        for fp in self.flat_params:
            fp.free()  # stage 3: a whole copy still up from backward (prefetch, reuse) would go stale
        self._set_kernel_inputs(factor, found_inf)
        sub_groups = self._sub_groups()
        for n, sub_group in enumerate(sub_groups):
            # Step a sub-group at a time: torch optimizers skip parameters without a gradient,
            # so the temporaries of a (CPU) step stay within sub_group_size elements.
            self._swap_in(sub_group, sub_groups[n + 1] if n + 1 < len(sub_groups) else None)
            sub_grads = [self._master_grad(fp) for fp in sub_group]
            if factor is not None and not self.skips_on_device and sub_grads:
                torch._foreach_mul_(sub_grads, factor.to(sub_grads[0].device))
            for fp, g in zip(sub_group, sub_grads):
                fp.master.grad = g
            self.optimizer.step()
            for fp in sub_group:
                fp.master.grad = None
                fp.copy_master_to_shard()  # after a skip on the device: the same values again
            if parked:
                self.nvme_grads.drop(sub_group)
            if self.nvme is not None:
                self.nvme.swap_out(sub_group)
        self._set_kernel_inputs(None, None)
        self._finish(found_inf, applied=True)

    def _finish(self, found_inf: torch.Tensor | None, applied: bool) -> None:
        if found_inf is not None:
            self.loss_scaler.update_scale(found_inf)
        self.zero_grad()
        if applied:
            self.all_gather_params()

    def _set_kernel_inputs(self, factor: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Hands a fused kernel what the gradients are divided by (1 / factor) and the skip flag
        (torch reads both as optimizer attributes), on the masters' device; cleared after the step."""
        if not self.skips_on_device:
            return
        device = self.flat_params[0].master.device if self.flat_params else self.comm_device
        self.optimizer.grad_scale = factor.reciprocal().to(device) if factor is not None else None
        self.optimizer.found_inf = found_inf.to(device) if found_inf is not None else None

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

    def _found_inf(self, nonfinite: torch.Tensor) -> torch.Tensor:
        """1.0 where any rank's gradients hold inf/nan, else 0.0: a MAX over ranks, on the device."""
        local = nonfinite.to(self.comm_device)
        if self.sharded:
            zdist.all_reduce(local, "scalar", op=dist.ReduceOp.MAX)
        return local

    def _global_norm(self, sum_sq: torch.Tensor) -> torch.Tensor:
        """L2 norm of the whole (still scaled) gradient: each rank sums squares over its shard only."""
        sq = sum_sq.to(self.comm_device)  # offloaded grads are on the CPU; NCCL reduces device tensors
        if self.sharded:
            zdist.all_reduce(sq, "scalar")
        return sq.sqrt()

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


def device_can_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can unscale and skip a step on the device: torch's own Adam/AdamW (not
    a subclass, whose step may differ) with every group fused, which take `grad_scale` and
    `found_inf` and undo the step count of a skipped step."""
    groups = optimizer.param_groups
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and bool(groups) and all(
        g.get("fused") for g in groups
    )


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
