"""The time of one optimizer step of a rung: compute, the engine's own collectives, what hides.

    predict_step(model, rung, workload, hardware, rates, accumulation) -> StepTime

Compute is FLOPs (model_flops.py) over the achievable rate. Communication is the list of
collectives the engine issues at that stage, built from its own bucket plan (the buckets
`model_states.bucket_layouts` gives the memory model too), each timed with hardware_rates'
latency + bytes/bandwidth model over the topology. Overlap is a small timeline per micro-step
with one compute stream and one communication stream, as NCCL runs them:

* stages 0-2: a bucket's reduction is issued when backward has produced its gradients (buckets
  come in backward order; a bucket is ready once the backward FLOPs of the parameters before it
  are done) and runs beside the rest of backward; what is left at the end is exposed. Stages 0-1
  reduce only in the boundary micro-step, 2-3 in every one;
* stage 3: a unit's all-gather is issued when the unit before it starts (prefetch), so it hides
  behind that unit's compute; the root unit's gather starts the step, exposed; backward
  re-gathers the units the live limit did not keep, one ahead;
* after the last backward: the optimizer step on the device, or, offloaded, the gradient
  copies to the CPU, the CPU optimizer (shared by the node's processes), NVMe traffic and the
  parameter copies back; then stages 1-2 all-gather the updated parameters. None of it hides.

With `rates.overlap` False (Gloo on CPUs, whose collectives run on the cores that compute)
every collective adds to the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from zerotrain.planning.hardware_rates import GB, Rates, bus_factor
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_flops import ModelFlops, model_flops
from zerotrain.planning.rung_memory import DTYPES, Hardware, Workload, rung_config

_FP32_STATE_BYTES = 12  # master + two Adam moments per element, what NVMe swaps in and out


@dataclass
class StepTime:
    """One optimizer step of a rung, predicted: its parts in seconds and what they add up to."""

    rung: Rung
    micro_batch: int
    accumulation: int
    world_size: int
    compute_s: float
    """Forward + backward (+ recompute) of every micro-step."""
    comm_s: float
    """Every collective's time, hidden or not."""
    exposed_comm_s: float
    """The part of `comm_s` the step waits for."""
    offload_s: float
    """Host copies, the CPU optimizer and NVMe traffic (none of it hides)."""
    optimizer_s: float
    """The optimizer step on the device (0 when offloaded)."""
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float | None
    """Model FLOPs (no recompute) per second over the device's datasheet peak; None without one."""
    bytes_sent: dict[str, float] = field(default_factory=dict)
    """Per collective kind, what one rank's calls move (COMM_COUNTER's accounting: all-reduce 2S)."""
    buffers_s: float = 0.0
    """The engine's own passes over its gradient buffers (`_buffer_passes`); 0 without a measured copy rate."""

    @property
    def exposed_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    @property
    def bottleneck(self) -> str:
        """The largest part of the step, in words."""
        parts = {"compute": self.compute_s, "communication": self.exposed_comm_s,
                 "offload": self.offload_s, "optimizer": self.optimizer_s + self.buffers_s}
        name, seconds = max(parts.items(), key=lambda kv: kv[1])
        share = seconds / self.step_s if self.step_s else 0.0
        words = {"compute": "compute-bound: forward and backward take",
                 "communication": "communication-bound: waiting on collectives takes",
                 "offload": "offload-bound: CPU optimizer and host copies take",
                 "optimizer": "optimizer-bound: the device's optimizer step and gradient buffers take"}[name]
        return f"{words} {share:.0%} of the step"

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "compute_s": self.compute_s, "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "exposed_comm_share": self.exposed_share, "offload_s": self.offload_s,
                "optimizer_s": self.optimizer_s, "buffers_s": self.buffers_s, "bottleneck": self.bottleneck,
                "micro_batch": self.micro_batch, "accumulation": self.accumulation,
                "bytes_sent_per_rank": dict(self.bytes_sent)}


def collective_s(kind: str, nbytes: float, world: int, gpus_per_node: int, rates: Rates) -> float:
    """Seconds of one collective of S = `nbytes` (nccl-tests' S) over `world` ranks.

    Ring: (n-1) steps per pass (two passes for all-reduce), each paying the latency of its hop,
    and S x factor / busbw; across nodes the busbw is the slower of the GPUs' link and the node's
    NICs together. All-reduce across nodes may take NCCL's tree instead (log-depth latency, the
    same bandwidth): the faster of the two is taken, as NCCL's tuner would.
    """
    if world <= 1 or nbytes <= 0:
        return 0.0
    if kind == "reduce_scatter" and rates.reduce_scatter_is_all_reduce:
        kind = "all_reduce"
    factor = bus_factor(kind, world)
    passes = 2 if kind == "all_reduce" else 1
    fit = rates.fits.get(kind)
    measured = fit.measured_s(nbytes) if fit is not None and world == fit.ranks else None
    if measured is not None:  # between two measured sizes on as many ranks: read off the measurements
        return measured
    if fit is not None:  # measured: its fixed cost grows with the ring's steps
        steps = max(1, fit.ranks - 1)
        return fit.fixed_s * (world - 1) / steps + nbytes * factor / (fit.busbw_gbps * GB)
    nodes = max(1, math.ceil(world / gpus_per_node))
    intra, inter = rates.intra, rates.inter
    if nodes > 1 and inter is None:
        raise ValueError(f"{world} GPUs span {nodes} nodes: say the inter-node link (e.g. --inter-node ib-ndr)")
    busbw = intra.busbw_gbps if nodes == 1 else min(intra.busbw_gbps, inter.busbw_gbps)
    wire = nbytes * factor / (busbw * GB)
    inter_hops = nodes if nodes > 1 else 0
    ring = passes * (inter_hops * (inter.latency_s if inter else 0) + (world - inter_hops) * intra.latency_s)
    if kind == "all_reduce" and nodes > 1:
        tree = 2 * (2 * math.log2(nodes) * inter.latency_s + (min(world, gpus_per_node) - 1) * intra.latency_s)
        ring = min(ring, tree)
    return ring + wire


@dataclass
class _Buckets:
    """The engine's buckets of a rung, in backward order: element counts and their stage-3 unit."""

    numel: list[int]
    shard: list[int]
    unit: list[int | None]
    persistent: list[bool]
    allgather_bucket: int
    max_live: int


def _buckets(model: nn.Module, rung: Rung, workload: Workload, hardware: Hardware, base: dict | None) -> _Buckets:
    from zerotrain.config import load_config, resolve_config
    from zerotrain.planning.model_states import bucket_layouts
    from zerotrain.zero.stage import StagePlan

    ds = rung_config(rung, workload, base)
    for key in ("offload_optimizer", "offload_param"):  # the buckets do not depend on where shards live
        ds["zero_optimization"].pop(key, None)
    world = hardware.world_size
    cfg = resolve_config(load_config(ds), world_size=world, model=model)
    zero = cfg.zero_optimization
    trainable = [[p for p in model.parameters() if p.requires_grad]]
    layouts = bucket_layouts(model, trainable, StagePlan(rung.stage), world, 0, zero.reduce_bucket_size,
                             zero.param_persistence_threshold)
    return _Buckets([b.padded_numel for b in layouts], [b.shard_size for b in layouts], [b.unit for b in layouts],
                    [b.persistent for b in layouts], int(zero.allgather_bucket_size), int(zero.max_live_parameters))


def predict_step(model: nn.Module, rung: Rung, workload: Workload, hardware: Hardware, rates: Rates,
                 accumulation: int = 1, base_config: dict | None = None,
                 flops: ModelFlops | None = None) -> StepTime:
    """The predicted time of one optimizer step of `rung` (see the module docstring)."""
    flops = flops or model_flops(model, workload.seq_len)
    world, per_node = hardware.world_size, hardware.gpus_per_node
    low = DTYPES[workload.dtype].itemsize
    buckets = _buckets(model, rung, workload, hardware, base_config)
    mb = workload.micro_batch
    rate = rates.device.tflops * 1e12
    # Attention is counted over the full square (as the profiler counts) and goes at the matmul rate: a
    # causal fused kernel skips the masked half but runs at about half a GEMM's efficiency. Tried both
    # ways against the published runs (benchmarks/step_time/published.py): halving it fit worse.
    attn_rate = (rates.attention_tflops or rates.device.tflops) * 1e12
    if rates.layer_tflops:  # measured on the model's own layer: norms and activations included
        layer_f = (flops.layer_matmul + flops.layer_attention) * mb / flops.layers / (rates.layer_tflops * 1e12)
    else:
        layer_f = (flops.layer_matmul / rate + flops.layer_attention / attn_rate) * mb / flops.layers
    head_f = flops.head_matmul * mb / ((rates.head_tflops or rates.device.tflops) * 1e12)
    if workload.loss_chunk_tokens:  # each chunk's logits are made again in backward: 4 head passes, not 3
        head_f *= 4 / 3
    # Recompute in backward, in layer forwards: whole layers one; selective only the ops that are not matmuls or
    # attention: the measured layer's time beyond its kernels', else memory-bound passes at the HBM bandwidth.
    recompute = 1.0 if rung.gradient_checkpointing is True else 0.0
    if rung.gradient_checkpointing == "selective" and rates.layer_tflops:
        kernels = (flops.layer_matmul / rate + flops.layer_attention / attn_rate) * mb / flops.layers
        recompute = max(0.0, 1 - kernels / layer_f)
    elif rung.gradient_checkpointing == "selective" and rates.device.memory_bandwidth_gbps:
        hbm = rates.device.memory_bandwidth_gbps * GB
        recompute = _elementwise_forward_bytes(model, workload) / hbm / layer_f

    def coll(kind: str, elements: int) -> float:
        return collective_s(kind, elements * low, world, per_node, rates)

    sent: dict[str, float] = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0}

    def count(kind: str, elements: float) -> None:
        sent[kind] += (2 if kind == "all_reduce" else 1) * elements * low

    h2d = rates.device.host_link_gbps * GB

    def param_copy(unit_elements: int) -> float:  # stage 3's offloaded shard, to the device before its gather
        return unit_elements / world * low / h2d if rung.offload_param != "none" else 0.0

    comm_total = 0.0
    exposed = compute = 0.0
    # Micro-steps before the boundary are all alike (stages 0-1 do not reduce in them): time one, count it.
    kind = "all_reduce" if rung.stage == 0 else "reduce_scatter"
    for boundary, repeats in ((False, accumulation - 1), (True, 1)):
        if repeats == 0:
            continue
        reduce = rung.stage >= 2 or boundary
        tally = {k: 0.0 for k in sent}
        fwd, bwd, comm, end = _micro_step(rung, buckets, layer_f, head_f, recompute, flops.layers, reduce, kind,
                                          coll, lambda k, n: tally.__setitem__(k, tally[k] + n), param_copy,
                                          rates.overlap)
        for k, n in tally.items():
            count(k, n * repeats)
        compute += (fwd + bwd) * repeats
        comm_total += comm * repeats
        exposed += (max(0.0, end - (fwd + bwd)) if comm else 0.0) * repeats
    optimizer = offload = 0.0
    shard = sum(buckets.shard) if rung.stage >= 1 else sum(buckets.numel)
    if rung.offload_optimizer == "none":
        optimizer = shard / rates.device.optimizer_elements_per_s
    else:
        cpu_rate = rates.cpu_adam_elements_per_s / per_node  # the node's cores are shared by its ranks
        offload = shard * low / h2d * 2 + shard / cpu_rate
        if rung.offload_optimizer == "nvme":
            offload += shard * _FP32_STATE_BYTES * 2 * per_node / (rates.nvme_gbps * GB)
    if rung.offload_param == "nvme":
        offload += accumulation * 2 * shard * low * per_node / (rates.nvme_gbps * GB)
    if rung.stage in (1, 2):  # updated shards gathered in allgather_bucket_size buckets
        gathered, pending = 0.0, 0
        for n in buckets.numel:
            if pending and pending + n > buckets.allgather_bucket:
                gathered, pending = gathered + coll("all_gather", pending), 0
            pending += n
            count("all_gather", n)
        gathered += coll("all_gather", pending)
        comm_total += gathered
        exposed += gathered
    if rung.stage >= 1:  # the gradient norm's and the overflow check's scalar all-reduces
        scalars = 2 * collective_s("all_reduce", 4, world, per_node, rates)
        comm_total, exposed = comm_total + scalars, exposed + scalars
    buffers = _buffer_passes(rung, accumulation, sum(buckets.numel), shard, low, world, rates)
    step = compute + exposed + offload + optimizer + buffers
    tokens = workload.seq_len * mb * accumulation
    model_f = 3 * flops.forward * mb * accumulation
    peak = rates.device.peak_tflops
    return StepTime(rung, mb, accumulation, world, compute, comm_total, exposed, offload, optimizer, step,
                    tokens / step, model_f / step / (peak * 1e12) if peak else None, sent, buffers)


def _buffer_passes(rung: Rung, accumulation: int, whole: int, shard: int, itemsize: int, world: int,
                   rates: Rates) -> float:
    """Seconds of the engine's own passes over its gradient buffers in one step, at the measured copy
    rates (a pass that reads and writes a buffer costs one copy of it, a read or a write alone half):

    * every backward: each parameter's gradient copied into its bucket's flat buffer (the whole
      gradient, `whole` elements). Stages 2-3 free that buffer after each reduction, so it is new
      memory every micro-step (`fresh_copy_gbps`: on a CPU its pages come from the OS again);
    * every reducing backward (more than one rank): the scaling by 1/world, in place over the whole
      buffer (stage 0 after its all-reduce, stages 1-3 before the reduction); stages 2-3 then add the
      reduced slice into the rank's gradient shard (read two, write one);
    * the step: the gradient norm (a read of the shard), the clipping (a read and a write; taken as
      always, gradients above the clip are the rule early in training) and, stages 2-3, clearing the shard.
    Stage 0's "shard" is the whole gradient. None of it overlaps anything (compute stream, or the cores).
    """
    if not rates.copy_gbps:
        return 0.0
    copy = rates.copy_gbps * GB
    fresh = (rates.fresh_copy_gbps or rates.copy_gbps) * GB
    nbytes, shard_bytes = whole * itemsize, shard * itemsize
    reducing = (accumulation if rung.stage >= 2 else 1) if world > 1 else 0
    seconds = accumulation * nbytes / (fresh if rung.stage >= 2 else copy)  # into the flat buffers
    seconds += reducing * nbytes / copy  # the 1/world scaling
    if rung.stage >= 2:
        seconds += reducing * 1.5 * shard_bytes / copy  # the reduced slice added into the shard
    seconds += 1.5 * shard_bytes / copy  # norm and clip
    if rung.stage >= 2:
        seconds += 0.5 * shard_bytes / copy  # the shard cleared for the next step
    return seconds


def _micro_step(rung, b: _Buckets, layer_f, head_f, recompute, layers, reduce, kind, coll, count, param_copy,
                overlap) -> tuple[float, float, float, float]:
    """(forward compute, backward compute, communication, end time) of one micro-step's timeline."""
    comm_free = comm = t = 0.0
    stage3 = rung.stage == 3
    units = sorted({u for u in b.unit if u is not None and u >= 0}, reverse=True)  # forward order

    def issue(seconds: float, at: float) -> float:
        """Queues a collective issued at `at` on the communication stream; returns when it ends."""
        nonlocal comm_free, comm
        comm += seconds
        comm_free = max(comm_free, at) + seconds
        return comm_free

    gathered: dict[int, int] = {}
    for n, unit, keep in zip(b.numel, b.unit, b.persistent):
        if unit is not None and not keep:
            gathered[unit] = gathered.get(unit, 0) + n

    def unit_numel(u: int) -> int:
        return gathered.get(u, 0)

    def unit_gather(u: int) -> float:
        count("all_gather", unit_numel(u))
        return param_copy(unit_numel(u)) + coll("all_gather", unit_numel(u))

    by_unit: dict[int, list[int]] = {}
    for n, unit in zip(b.numel, b.unit):
        by_unit.setdefault(unit, []).append(n)

    def reduce_unit(u: int, at: float) -> None:
        for n in by_unit.get(u, ()):
            count(kind, n)
            issue(coll(kind, n), at)

    # Forward.
    if stage3:
        t = issue(unit_gather(-1), 0.0)  # the root unit: nothing to hide behind
        previous_start = t
        for u in units:
            ready = issue(unit_gather(u), previous_start)  # prefetched when the unit before started
            previous_start = max(t, ready)
            t = previous_start + layer_f
    else:
        t += layer_f * layers
    t += head_f
    fwd = layer_f * layers + head_f
    # Backward: the head first, then the layers last to first; buckets as they fill.
    bwd_layer = layer_f * (2 + recompute)
    bwd = 2 * head_f + bwd_layer * layers
    start_bwd = t
    t += 2 * head_f
    if stage3:
        # The live limit keeps the last units of forward gathered for backward (reuse); the rest are
        # gathered again, each prefetched when the unit after it (in forward order) starts backward.
        kept, regather = b.max_live, set()
        for u in reversed(units):
            if kept >= unit_numel(u):
                kept -= unit_numel(u)
            else:
                regather.add(u)
        order = list(reversed(units))
        ready = {order[0]: issue(unit_gather(order[0]), t)} if order and order[0] in regather else {}
        for k, u in enumerate(order):
            t = max(t, ready.get(u, 0.0))
            if k + 1 < len(order) and order[k + 1] in regather:
                ready[order[k + 1]] = issue(unit_gather(order[k + 1]), t)
            t += bwd_layer
            if reduce:
                reduce_unit(u, t)
        if reduce:
            reduce_unit(-1, t)
    else:
        total = sum(b.numel) or 1
        done_elements = 0
        backward_s = bwd - 2 * head_f
        for n in b.numel:
            done_elements += n
            if reduce:
                count(kind, n)
                issue(coll(kind, n), start_bwd + 2 * head_f + backward_s * done_elements / total)
        t = start_bwd + bwd
    end = max(t, comm_free) if overlap else fwd + bwd + comm
    return fwd, bwd, comm, end


# Eager Hugging Face Llama layers' forward moves about 29 x tokens x (hidden + intermediate) elements of the
# compute dtype outside matmuls and attention (norms in fp32, rotary, SiLU, products, residuals, copies):
# measured on an H100 (benchmarks/step_time/h100-2026-11-27: 2.15 ms of a 1.1B layer's forward at 16,384
# tokens, HBM 3.35 TB/s). Selective checkpointing recomputes these in backward.
ELEMENTWISE_PASSES = 29


def _elementwise_forward_bytes(model: nn.Module, workload: Workload) -> float:
    """Bytes a layer's forward moves outside its matmuls and attention."""
    c = model.config
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    inner = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    tokens = workload.micro_batch * workload.seq_len
    return ELEMENTWISE_PASSES * tokens * (hidden + inner) * DTYPES[workload.dtype].itemsize
