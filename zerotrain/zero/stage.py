"""The stage table: one machine, with different things kept whole or sharded.

| stage | low-precision params | gradients                             | fp32 master + optimizer state |
| ----- | -------------------- | ------------------------------------- | ----------------------------- |
| 0     | whole                | whole, all-reduced during backward    | whole                         |
| 1     | whole                | whole, reduce-scattered in backward   | shard                         |
| 2     | whole                | shard, reduce-scattered in backward   | shard                         |
| 3     | shard, gathered per unit for use | shard, reduce-scattered in backward | shard                 |

`build_flat_params` applies it to a model: buckets its trainable parameters,
makes every rank start from rank 0's weights (or, for a model built under
`zero.Init`, materializes it unit by unit), creates the master shards and casts
to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.comm import distributed as zdist
from zerotrain.zero.flat_param import FlatParam, split_into_buckets
from zerotrain.zero.init_context import Materializer, has_deferred_params
from zerotrain.zero.partitioned_param import mark_whole
from zerotrain.zero.units import assign_params_to_units, find_layer_units

if TYPE_CHECKING:
    from zerotrain.zero.nvme_offload import NvmeOptimizerOffload
    from zerotrain.zero.nvme_params import NvmeParamOffload


@dataclass(frozen=True)
class StagePlan:
    """What a ZeRO stage keeps sharded, and when it reduces gradients."""

    stage: int

    @property
    def shards_optimizer(self) -> bool:
        """fp32 master weights and optimizer state exist only for the rank's shard."""
        return self.stage >= 1

    @property
    def shards_params(self) -> bool:
        """Parameters are whole only while their unit computes (stage 3)."""
        return self.stage == 3

    @property
    def keeps_whole_grads(self) -> bool:
        """Whole gradients stay allocated between micro-steps (stages 0 and 1)."""
        return self.stage <= 1

    def reduces_in_backward(self, boundary: bool) -> bool:
        """Stages 0 and 1 reduce (all-reduce / reduce-scatter) during the boundary backward, bucket by
        bucket as backward fills them, and accumulate locally before it; stages 2-3 reduce-scatter
        in every backward."""
        return self.stage >= 2 or boundary


@dataclass(frozen=True)
class OffloadPlan:
    """Where the shards live when offloaded (None: on the compute device)."""

    optimizer_device: torch.device | None = None  # fp32 master + optimizer state; the step runs there
    param_device: torch.device | None = None  # stage 3 parameter shards between uses
    pin_memory: bool = False
    param_swap: "NvmeParamOffload | None" = None  # stage 3 parameter shards parked on NVMe
    state_swap: "NvmeOptimizerOffload | None" = None  # fp32 masters (and optimizer state) parked on NVMe
    grads_parked: bool = False  # gradient shards parked on NVMe (NvmeGradOffload makes them)


def build_flat_params(
    model: nn.Module,
    param_groups: list[list[nn.Parameter]],
    plan: StagePlan,
    bucket_numel: int,
    compute_dtype: torch.dtype,
    persistence_threshold: int = 0,
    offload: "OffloadPlan | None" = None,
) -> list[FlatParam]:
    """Flattens each param group's trainable parameters into FlatParam buckets.

    Parameters are taken in reverse registration order, roughly the order backward
    produces their gradients, so the first bucket fills first. Buckets are made a unit
    at a time (stage 3) and sharded before the next unit's are made. A model built under
    `zero.Init` is materialized here, unit by unit, straight into its buckets.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    offload = offload or OffloadPlan()
    names: dict[nn.Parameter, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, n)  # tied weights keep their first name, as named_parameters() reports
    units = find_layer_units(model)
    deferred = Materializer(model, units, world) if has_deferred_params(model) else None
    flat_params: list[FlatParam] = []
    for unit, buckets in plan_buckets(model, units, param_groups, plan, bucket_numel, persistence_threshold):
        batch = []
        for g, bucket, persistent in buckets:
            fp = FlatParam(bucket, [names.get(p, "?") for p in bucket], g, world, rank, plan.shards_optimizer)
            fp.unit = unit
            fp.persistent = persistent
            batch.append(fp)
        if deferred is not None:
            deferred.materialize(batch, unit)  # the same values on every rank: nothing to broadcast
        elif world > 1:
            for fp in batch:  # DeepSpeed starts every rank from rank 0's weights; so do we.
                zdist.broadcast(fp.data, 0, "init")
        for fp in batch:
            # Never pin what an NVMe store parks: Tensor.pin_memory() storage cannot be resize_()d.
            fp.make_master(compute_dtype, offload.optimizer_device, offload.pin_memory and offload.state_swap is None)
            fp.cast_to(compute_dtype)
            if plan.shards_params and not fp.persistent:
                fp.keep_only_shard(offload.param_device, offload.pin_memory and offload.param_swap is None)
                if offload.param_swap is not None:
                    offload.param_swap.adopt(fp)  # parked before the next unit exists
            if offload.state_swap is not None:
                offload.state_swap.adopt(fp)
        flat_params.extend(batch)
    if deferred is not None:
        deferred.finish()  # units with no trainable parameters
    elif world > 1:
        flat = {p for fp in flat_params for p in fp.params}
        for t in [p for p in model.parameters() if p not in flat] + list(model.buffers()):
            zdist.broadcast(t.data, 0, "init")
    if compute_dtype != torch.float32:
        model.to(compute_dtype)  # frozen parameters and floating buffers (buckets are cast already)
    if plan.shards_params:
        for p in model.parameters():
            mark_whole(p)  # no-op for sharded ones; scripts test `ds_status` on every parameter
    for fp in flat_params:
        if plan.keeps_whole_grads:
            fp.ensure_grad_full()
        elif not offload.grads_parked:
            fp.grad_of_shard()
    return flat_params


def plan_buckets(model, units, param_groups, plan: StagePlan, bucket_numel: int, persistence_threshold: int):
    """(unit, [(group, parameters, persistent) per FlatParam]) in the order backward completes them.

    Pure: reads only parameter sizes and the module tree, so it runs on meta parameters too
    (zerotrain/planning/model_states.py predicts the engine's memory with it).

    Stages 0-2: one batch (unit None) of reverse registration order cut into `bucket_numel`
    buckets. Stage 3: per unit, one bucket per group, the layer units last to first, then
    the root unit, whose embedding gradient is the last one backward produces. Parameters
    smaller than `persistence_threshold` (norms, biases) go to a per-unit bucket that stays
    whole, as stage 2 keeps them: gathering many tiny tensors costs more latency than it
    saves memory.
    """
    group_of = {p: g for g, params in enumerate(param_groups) for p in params}
    if not plan.shards_params:
        yield None, [
            (g, bucket, False)
            for g, params in enumerate(param_groups)
            for bucket in split_into_buckets(list(reversed(params)), bucket_numel)
        ]
        return
    per_unit, root = assign_params_to_units(model, units)
    for unit, params in [*reversed(list(zip(units, per_unit))), (model, root)]:
        batch = []
        for g in range(len(param_groups)):
            in_group = [p for p in params if group_of.get(p) == g]
            for persistent in (False, True):
                bucket = [p for p in in_group if (p.numel() < persistence_threshold) == persistent]
                if bucket:
                    batch.append((g, bucket, persistent))
        if batch:
            yield unit, batch
