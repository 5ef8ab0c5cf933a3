"""The stage table: one machine, with different things kept whole or sharded.

| stage | low-precision params | gradients                             | fp32 master + optimizer state |
| ----- | -------------------- | ------------------------------------- | ----------------------------- |
| 0     | whole                | whole, all-reduced during backward    | whole                         |
| 1     | whole                | whole, reduce-scattered at the step   | shard                         |
| 2     | whole                | shard, reduce-scattered in backward   | shard                         |
| 3     | shard, gathered per unit for use | shard, reduce-scattered in backward | shard                 |

`build_flat_params` applies it to a model: buckets its trainable parameters,
makes every rank start from rank 0's weights, creates the master shards and
casts to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerotrain import distributed as zdist
from zerotrain.zero.flat_param import FlatParam, split_into_buckets
from zerotrain.zero.units import assign_params_to_units, find_layer_units


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
        """Stage 0 all-reduces during the boundary backward; stage 2 reduce-scatters every backward."""
        return self.stage >= 2 or (self.stage == 0 and boundary)


@dataclass(frozen=True)
class OffloadPlan:
    """Where the shards live when offloaded (None: on the compute device)."""

    optimizer_device: torch.device | None = None  # fp32 master + optimizer state; the step runs there
    param_device: torch.device | None = None  # stage 3 parameter shards between uses
    pin_memory: bool = False


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
    produces their gradients, so the first bucket fills first.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    names: dict[nn.Parameter, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, n)  # tied weights keep their first name, as named_parameters() reports
    flat_params: list[FlatParam] = []
    for g, bucket, unit, persistent in _buckets(model, param_groups, plan, bucket_numel, persistence_threshold):
        fp = FlatParam(bucket, [names.get(p, "?") for p in bucket], g, world, rank, plan.shards_optimizer)
        fp.unit = unit
        fp.persistent = persistent
        flat_params.append(fp)
    if world > 1:
        # DeepSpeed starts every rank from rank 0's weights; so do we.
        for fp in flat_params:
            zdist.broadcast(fp.data, 0, "init")
        flat = {p for fp in flat_params for p in fp.params}
        for t in [p for p in model.parameters() if p not in flat] + list(model.buffers()):
            zdist.broadcast(t.data, 0, "init")
    offload = offload or OffloadPlan()
    for fp in flat_params:
        fp.make_master(compute_dtype, offload.optimizer_device, offload.pin_memory)
    if compute_dtype != torch.float32:
        model.to(compute_dtype)  # frozen parameters and floating buffers
        for fp in flat_params:
            fp.cast_to(compute_dtype)
    if plan.shards_params:
        for fp in flat_params:
            if not fp.persistent:
                fp.keep_only_shard(offload.param_device, offload.pin_memory)
    for fp in flat_params:
        if plan.keeps_whole_grads:
            fp.ensure_grad_full()
        else:
            fp.grad_of_shard()
    return flat_params


def _buckets(model, param_groups, plan: StagePlan, bucket_numel: int, persistence_threshold: int):
    """(group, parameters, unit, persistent) per FlatParam, in the order backward completes them.

    Stages 0-2: reverse registration order cut into `bucket_numel` buckets. Stage 3: one
    bucket per (unit, group), the layer units last to first, then the root unit, whose
    embedding gradient is the last one backward produces. Parameters smaller than
    `persistence_threshold` (norms, biases) go to a per-unit bucket that stays whole, as
    stage 2 keeps them: gathering many tiny tensors costs more latency than it saves memory.
    """
    group_of = {p: g for g, params in enumerate(param_groups) for p in params}
    if not plan.shards_params:
        for g, params in enumerate(param_groups):
            for bucket in split_into_buckets(list(reversed(params)), bucket_numel):
                yield g, bucket, None, False
        return
    units = find_layer_units(model)
    per_unit, root = assign_params_to_units(model, units)
    for unit, params in [*reversed(list(zip(units, per_unit))), (model, root)]:
        for g in range(len(param_groups)):
            in_group = [p for p in params if group_of.get(p) == g]
            for persistent in (False, True):
                bucket = [p for p in in_group if (p.numel() < persistence_threshold) == persistent]
                if bucket:
                    yield g, bucket, unit, persistent
