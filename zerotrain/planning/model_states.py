"""Model states per rank: the bytes the engine will allocate, predicted without allocating.

`model_states_per_rank` answers, for a model (on the meta device, or built under
`zero.Init`) and a DeepSpeed config, what `engine.memory_breakdown()` will report on a
rank: parameters, gradients, fp32 master and optimizer state, padding included. It
runs the engine's own plan on the meta parameters — the same buckets
(`zero.stage.plan_buckets`) and the same padding and shard arithmetic
(`zero.flat_param.shard_layout`) — so the two cannot drift apart. Only the optimizer's
state is measured elsewhere: on a two-element probe of the configured optimizer, which
shows which state tensors are per element (exp_avg, momentum) and which are scalars (step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from zerotrain.compat.initialize import param_groups_of
from zerotrain.config import load_config, resolve_config
from zerotrain.zero.flat_param import shard_layout
from zerotrain.zero.stage import StagePlan, plan_buckets
from zerotrain.zero.units import find_layer_units

# The keys of `engine.memory_breakdown()` (ZeroOptimizer.resident_bytes), in its order.
MODEL_STATE_KEYS = ("params", "grads", "master", "optimizer_state", "optimizer_scalars")

_PROBE_NUMEL = 2  # a probe element count above 1: resident_bytes calls 1-element tensors scalars


@dataclass(frozen=True)
class BucketLayout:
    """One FlatParam as the engine will build it: sizes only."""

    group_index: int
    numel: int
    padded_numel: int
    shard_size: int
    persistent: bool  # stage 3: kept whole like stage 2's parameters
    unit: int | None = None  # stage 3: index of its unit in backward order, -1 for the root; None below 3


@dataclass(frozen=True)
class OptimizerStateShape:
    """What the optimizer keeps per master tensor: bytes per element, and fixed bytes (scalars)."""

    per_element_bytes: tuple[int, ...]  # one entry per per-element state tensor (element size)
    scalar_bytes: int  # scalar state (Adam's step), per master tensor


def model_states_per_rank(
    model: nn.Module,
    config: Any,
    world_size: int,
    rank: int = 0,
    *,
    param_groups: Iterable | None = None,
    after_first_step: bool = True,
    device_type: str | None = None,
) -> dict[str, int]:
    """Bytes `engine.memory_breakdown()` will report on `rank`, keyed as it is.

    Args:
        model: the model, best on the meta device (nothing is allocated or read from it).
        config: a DeepSpeed config (dict, path or ZeroTrainConfig); "auto" values are
            resolved for `world_size` as `zerotrain.initialize` does.
        world_size: data-parallel ranks.
        rank: the rank to predict (today every rank holds the same bytes: shards are equal).
        param_groups: what `initialize(model_parameters=...)` gets: parameters or torch-style
            groups (default: all of the model's). Group order changes the buckets at stages 0-2.
        after_first_step: True (default) for the steady state after an optimizer step; False
            for right after `initialize`, before a lazily built optimizer state exists.
        device_type: the compute device's type, "cuda" or "cpu" (default: this machine's, as the
            engine picks it). It matters once: in fp32 the master is the parameter itself unless
            the optimizer is offloaded to another device, and "cpu" offload on a CPU is no move.

    Frozen parameters, buffers and activations are not model states in this accounting
    (memory_breakdown counts neither). NVMe offload parks the shards on disk and is not
    predicted: it raises NotImplementedError.
    """
    cfg = resolve_config(load_config(config), world_size=world_size, model=model)
    zero = cfg.zero_optimization
    offload_opt = _offload_device(zero.offload_optimizer)
    offload_par = _offload_device(zero.offload_param)
    if "nvme" in (offload_opt, offload_par):
        raise NotImplementedError("NVMe offload: the resident bytes of parked shards are not predicted")
    groups = param_groups_of(model, model_parameters=param_groups)
    trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
    options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    plan = StagePlan(zero.stage)
    buckets = bucket_layouts(model, trainable, plan, world_size, rank, zero.reduce_bucket_size,
                             zero.param_persistence_threshold)
    low = torch.empty(0, dtype=cfg.compute_dtype).element_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    # FlatParam.make_master: fp32 and the master on the parameters' device -> no copy.
    master_is_param = cfg.compute_dtype == torch.float32 and (offload_opt is None or device_type == "cpu")

    out = dict.fromkeys(MODEL_STATE_KEYS, 0)
    for b in buckets:
        if plan.shards_params and not b.persistent:
            out["params"] += b.shard_size * low  # the kept shard; the whole buffer is freed
        else:
            out["params"] += b.padded_numel * low
        if plan.keeps_whole_grads:
            out["grads"] += b.padded_numel * low  # stage 1's shard exists only inside the step
        else:
            out["grads"] += b.shard_size * low
        if not master_is_param:
            out["master"] += b.shard_size * 4
    factory = _optimizer_factory(cfg)
    for g, opts in enumerate(options):
        sizes = [b.shard_size for b in buckets if b.group_index == g]
        if not sizes:
            continue  # the engine builds no group for it
        shape = optimizer_state_shape(factory, opts, after_first_step)
        for size in sizes:
            per_element = sum(size * e for e in shape.per_element_bytes)
            out["optimizer_state" if size > 1 else "optimizer_scalars"] += per_element
            out["optimizer_scalars"] += shape.scalar_bytes
    return out


def bucket_layouts(
    model: nn.Module,
    trainable: list[list[nn.Parameter]],
    plan: StagePlan,
    world_size: int,
    rank: int,
    bucket_numel: int,
    persistence_threshold: int,
) -> list[BucketLayout]:
    """The engine's FlatParams for `trainable` (one list per param group), as sizes."""
    units = find_layer_units(model)
    out = []
    for index, (unit, batch) in enumerate(plan_buckets(model, units, trainable, plan, bucket_numel,
                                                       persistence_threshold)):
        unit_index = None if unit is None else (-1 if unit is model else index)
        for g, params, persistent in batch:
            numel = sum(p.numel() for p in params)
            padded, shard, _start = shard_layout(numel, world_size, rank, plan.shards_optimizer)
            out.append(BucketLayout(g, numel, padded, shard, persistent, unit_index))
    return out


def optimizer_state_shape(factory, group_options: Mapping[str, Any], after_first_step: bool) -> OptimizerStateShape:
    """The configured optimizer's state per master tensor, measured on a two-element probe.

    Measured, not tabled: Adam keeps two moments and a step, SGD a momentum buffer only with
    momentum, Adagrad builds its state at construction, and group options (amsgrad) change it.
    """
    probe = torch.zeros(_PROBE_NUMEL, dtype=torch.float32, requires_grad=True)
    optimizer = factory([{**group_options, "params": [probe]}])
    if after_first_step:
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
    per_element: list[int] = []
    scalar = 0
    for v in optimizer.state.get(probe, {}).values():
        if torch.is_tensor(v):
            if v.numel() == _PROBE_NUMEL:
                per_element.append(v.element_size())
            else:
                scalar += v.untyped_storage().nbytes()
    return OptimizerStateShape(tuple(per_element), scalar)


def _optimizer_factory(cfg):
    """What the engine builds over the master shards when the config names the optimizer."""
    from zerotrain.optim import build_optimizer

    opt = cfg.optimizer
    if opt is None:
        return lambda groups: torch.optim.SGD(groups, lr=0.0)  # the engine's forward-only stand-in
    return lambda groups: build_optimizer(opt.type, dict(opt.params), groups)


def _offload_device(section) -> str | None:
    return section.device if section is not None and section.device != "none" else None
