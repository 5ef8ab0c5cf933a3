"""Memory of one rung: what a GPU, a node's CPU and a node's NVMe hold at the peak of a step.

The model states come from `model_states_per_rank` (the engine's own bucket plan, byte-exact),
split by where the rung keeps them. The transient terms are the engine's buffers at their
largest: whole-gradient buckets awaiting their reduce-scatter, stage 3's gathered units
(the root unit stays gathered for the whole step; layers are gathered up to the live limit),
the activations autograd saves, and the LM head's logits peak (`activation_memory`; when one
layer's backward outgrows the logits' peak, which it never coexists with, "activations" holds the
difference). The peak of a step is their sum: it falls early in backward, when every activation
is saved, the logits and their gradient (or one layer's backward) exist, and the first gradient
buckets fill.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerotrain.config import load_config, resolve_config
from zerotrain.config.byte_sizes import format_bytes
from zerotrain.planning.activation_memory import LongSequence
from zerotrain.planning.ladder import Rung
from zerotrain.planning.model_states import bucket_layouts, model_states_per_rank
from zerotrain.planning.pinned_memory import pinned_bytes
from zerotrain.zero.optimizer import sub_group_counts
from zerotrain.zero.stage import StagePlan

GIB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The GPU memory a job cannot use for tensors: the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation. Measured jobs lose 0.5-1.5 GiB to the first two.
RESERVE_FRACTION = 0.05
RESERVE_MIN_BYTES = GIB
# The host memory a node's training processes cannot use for model states: what the OS holds, and
# each process's CUDA context, libraries and Python objects. Measured on an H100 machine (126 GiB):
# the idle OS held 1.8 GiB, a 7B ZeRO-Offload process 3.6 GiB beyond its states and pinned rounding
# (docs/benchmarks.md, section 6).
HOST_RESERVE_OS_BYTES = 2 * GIB
HOST_RESERVE_PER_PROCESS_BYTES = 4 * GIB
# Whole-gradient buckets alive at once at stages 2-3: one filling, two awaiting their reduce-scatter
# (zero/grad_reducer.py keeps at most two in flight).
_GRAD_BUCKETS_ALIVE = 3


@dataclass(frozen=True)
class Workload:
    """What one optimizer step computes, per GPU."""

    seq_len: int
    """Tokens per sample."""
    micro_batch: int
    """Samples per GPU per forward."""
    dtype: str = "bf16"
    """Compute dtype: "bf16", "fp16" or "fp32"."""
    attention: str = "sdpa"
    """Attention kernel: "sdpa" (fused, no score matrix kept) or "eager"."""
    loss_chunk_tokens: int | None = None
    """zerotrain train's training.loss_chunk_tokens: the LM head and loss this many tokens at a time
    (one chunk's logits at most); None: the model's own loss, all logits at once."""
    long_sequence: LongSequence = LongSequence()
    """Sequence parallelism, tiled MLP, offloaded activations (training.sequence_parallel_size,
    tiled_mlp, offload_activations); `micro_batch` then counts samples per sequence-parallel group."""

    @classmethod
    def of_train_config(cls, cfg, dtype: str) -> Workload:
        """The workload of a `zerotrain train` config (a TrainConfig) at `dtype`: its sequence,
        micro-batch, loss chunks and long-sequence switches."""
        t = cfg.training
        return cls(cfg.data.seq_len, t.micro_batch_size, dtype, loss_chunk_tokens=t.loss_chunk_tokens,
                   long_sequence=LongSequence.of_train_config(cfg))


@dataclass(frozen=True)
class Hardware:
    """The machines a job runs on. Memory in bytes; None: not limited (nothing is checked)."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    """Memory of one GPU."""
    cpu_memory: int | None = None
    """Memory of one node's CPU, shared by its GPUs' processes."""
    nvme_path: str | None = None
    """A local NVMe folder; the NVMe rungs are considered only with one."""

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_reserve(self) -> int:
        """Bytes of each GPU the estimate keeps free for the CUDA context and fragmentation."""
        if self.gpu_memory is None:
            return 0
        return max(RESERVE_MIN_BYTES, int(self.gpu_memory * RESERVE_FRACTION))

    @property
    def cpu_reserve(self) -> int:
        """Bytes of each node's memory the estimate keeps free for the OS and the processes' runtime."""
        if self.cpu_memory is None:
            return 0
        return HOST_RESERVE_OS_BYTES + HOST_RESERVE_PER_PROCESS_BYTES * self.gpus_per_node


@dataclass
class RungEstimate:
    """The bytes of one rung, per GPU and per node, and whether they fit the hardware."""

    rung: Rung
    micro_batch: int
    gpu: dict[str, int] = field(default_factory=dict)
    cpu_per_node: dict[str, int] = field(default_factory=dict)
    nvme_per_node: dict[str, int] = field(default_factory=dict)
    gpu_reserve: int = 0
    fits: bool = True
    overflow: list[str] = field(default_factory=list)
    """Why it does not fit: which memory, by how much, and its largest term."""

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu_per_node.values())

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme_per_node.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "rung": self.rung.name, "stage": self.rung.stage, "offload_optimizer": self.rung.offload_optimizer,
            "offload_param": self.rung.offload_param, "gradient_checkpointing": self.rung.gradient_checkpointing,
            "micro_batch": self.micro_batch, "gpu_bytes": dict(self.gpu), "gpu_total": self.gpu_total,
            "gpu_reserve": self.gpu_reserve, "cpu_bytes_per_node": dict(self.cpu_per_node),
            "cpu_total_per_node": self.cpu_total, "nvme_bytes_per_node": dict(self.nvme_per_node),
            "nvme_total_per_node": self.nvme_total, "fits": self.fits, "overflow": list(self.overflow),
        }


def rung_config(rung: Rung, workload: Workload, base_config: dict | None = None, nvme_path: str | None = None) -> dict:
    """The DeepSpeed config of `rung`: `base_config` with the rung's ZeRO section, dtype and micro-batch."""
    cfg = copy.deepcopy(base_config) if base_config else {}
    zero = {k: v for k, v in (cfg.get("zero_optimization") or {}).items()
            if k not in ("stage", "offload_optimizer", "offload_param")}
    cfg["zero_optimization"] = {**zero, **rung.zero_optimization(nvme_path)}
    for key in ("bf16", "fp16"):
        cfg.pop(key, None)
    if workload.dtype in ("bf16", "fp16"):
        cfg[workload.dtype] = {"enabled": True}
    cfg["train_micro_batch_size_per_gpu"] = workload.micro_batch
    if workload.long_sequence.sequence_parallel > 1:
        cfg["sequence_parallel_size"] = workload.long_sequence.sequence_parallel
    cfg.setdefault("gradient_accumulation_steps", 1)
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if cfg.get(key) == "auto":
            cfg.pop(key)
    cfg.pop("train_batch_size", None)  # the plan chooses accumulation; the batch follows
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}})
    return _memory_neutral_autos_filled(cfg)


# "auto" values the Trainer or Accelerate would fill that change no byte of memory.
_NEUTRAL_AUTOS = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _memory_neutral_autos_filled(cfg: dict) -> dict:
    """A config whose remaining "auto"s are the ones the model resolves (bucket sizes)."""
    cfg.pop("scheduler", None)  # schedules change no memory
    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = 1.0
    params = (cfg.get("optimizer") or {}).get("params") or {}
    for key, value in list(params.items()):
        if value == "auto":
            params[key] = _NEUTRAL_AUTOS.get(key, value)
    return cfg


def estimate_rung(
    model: nn.Module,
    rung: Rung,
    workload: Workload,
    hardware: Hardware,
    base_config: dict | None = None,
) -> RungEstimate:
    """Bytes per GPU, per node's CPU and per node's NVMe of `rung` at `workload`'s micro-batch.

    Args:
        model: the model, on the meta device (see `model_source.load_meta_model`).
        rung: stage, offload and checkpointing.
        workload: sequence length, micro-batch, dtype and attention kernel.
        hardware: GPUs per node and nodes (the data-parallel size), and the memory limits.
        base_config: a DeepSpeed config whose other settings (optimizer, bucket sizes,
            stage-3 limits) apply; the rung replaces its stage and offload.
    """
    from zerotrain.planning.activation_memory import estimate_activations

    world = hardware.world_size
    ds = rung_config(rung, workload, base_config, hardware.nvme_path)
    # The bytes of an NVMe-parked shard are the bytes it would take on the CPU: count them there, then move.
    counted = copy.deepcopy(ds)
    for key in ("offload_optimizer", "offload_param"):
        section = counted["zero_optimization"].get(key)
        if section and section["device"] == "nvme":
            counted["zero_optimization"][key] = {"device": "cpu"}
    cfg = resolve_config(load_config(counted), world_size=world, model=model)
    states = model_states_per_rank(model, cfg, world, device_type="cuda")
    zero = cfg.zero_optimization
    low = torch.empty(0, dtype=cfg.compute_dtype).element_size()
    trainable = [[p for p in model.parameters() if p.requires_grad]]
    plan = StagePlan(rung.stage)
    buckets = bucket_layouts(model, trainable, plan, world, 0, zero.reduce_bucket_size,
                             zero.param_persistence_threshold)

    gpu: dict[str, int] = {}
    host = {"cpu": {}, "nvme": {}}
    optimizer_bytes = states["master"] + states["optimizer_state"] + states["optimizer_scalars"]
    offloaded_params = 0
    if rung.offload_param != "none":
        offloaded_params = sum(b.shard_size * low for b in buckets if not b.persistent)
    gpu["parameters"] = states["params"] - offloaded_params
    if offloaded_params:
        host[rung.offload_param]["parameters"] = offloaded_params
    # Stages 2-3 with the optimizer offloaded: each reduced gradient shard goes where the step runs.
    grads_off = rung.offload_optimizer != "none" and rung.stage >= 2
    gpu["gradients"] = 0 if grads_off else states["grads"]
    if grads_off:
        host[rung.offload_optimizer]["gradients"] = states["grads"]
    gpu["master + optimizer"] = optimizer_bytes if rung.offload_optimizer == "none" else 0
    if rung.offload_optimizer != "none":
        host[rung.offload_optimizer]["master + optimizer"] = optimizer_bytes
    if rung.offload_optimizer != "none":
        host["cpu"]["optimizer step temporaries"] = _step_temporary_bytes(buckets, zero.sub_group_size, low)
    rounding = _pinned_rounding_bytes(buckets, rung, zero, grads_off, low)
    if rounding:
        host["cpu"]["pinned-memory rounding"] = rounding
    if rung.uses_nvme:
        # NVMe shards are swapped through host memory one bucket at a time.
        largest = max((b.shard_size for b in buckets), default=0)
        host["cpu"]["nvme swap buffers"] = largest * (12 + low) * 2
    gpu["gradient buckets"] = _gradient_bucket_bytes(buckets, rung.stage, low)
    gpu["gathered units"] = _gathered_unit_bytes(buckets, zero, low) if rung.stage == 3 else 0
    act = estimate_activations(model.config, workload.seq_len, workload.micro_batch,
                               DTYPES[workload.dtype], workload.attention, loss_chunk_tokens=workload.loss_chunk_tokens,
                               long_sequence=workload.long_sequence)
    gpu["activations"] = act.total(rung.gradient_checkpointing) - act.logits_peak_bytes
    gpu["logits peak"] = act.logits_peak_bytes
    offloaded = act.host(rung.gradient_checkpointing)
    if offloaded:
        host["cpu"]["offloaded activations"] = offloaded

    est = RungEstimate(
        rung, workload.micro_batch, gpu,
        {k: v * hardware.gpus_per_node for k, v in host["cpu"].items()},
        {k: v * hardware.gpus_per_node for k, v in host["nvme"].items()},
        hardware.gpu_reserve,
    )
    _check_fit(est, hardware)
    return est


def _gradient_bucket_bytes(buckets, stage: int, low: int) -> int:
    """Whole-gradient buffers beyond the resident gradients: stages 2-3 build them per bucket in backward."""
    if stage <= 1:
        return 0  # the whole gradients are resident already (counted as gradients) and reduced in place
    sizes = sorted((b.padded_numel for b in buckets), reverse=True)
    return sum(sizes[:_GRAD_BUCKETS_ALIVE]) * low


def _step_temporary_bytes(buckets, sub_group_size: int, low: int) -> int:
    """An offloaded step's own buffers, on the CPU. It steps one sub-group of master shards at a
    time (zero/optimizer.py), with that sub-group's gradients copied to fp32, after reading each
    bucket's norm in fp32; Adam on the CPU is torch's fused kernel, which makes no temporary.
    Nothing is copied when the gradients are fp32 already."""
    if low == 4:
        return 0
    sizes = [b.shard_size for b in buckets]
    largest, start = 0, 0
    for count in sub_group_counts(sizes, sub_group_size):
        largest = max(largest, sum(sizes[start : start + count]))
        start += count
    return (largest + max(sizes, default=0)) * 4


def _pinned_rounding_bytes(buckets, rung: Rung, zero, grads_off: bool, low: int) -> int:
    """What page-locked buffers take beyond their size. torch's pinned allocator (the caching host
    allocator, `tensor.pin_memory()`) rounds every request up to a power of two, and the engine pins
    per bucket: each offloaded master shard (fp32), gradient shard and stage-3 parameter shard. A
    bucket of 486M elements pins 2 GiB for its 1.8 GiB master: 4.7 GiB in all for a 7B model."""
    def waste(nbytes: int) -> int:
        return pinned_bytes(nbytes) - nbytes

    pinned: list[int] = []
    if rung.offload_optimizer == "cpu":
        if zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory:
            pinned += [b.shard_size * 4 for b in buckets]
        if grads_off:  # reduced gradient shards are pinned whenever they live on the CPU
            pinned += [b.shard_size * low for b in buckets]
    if rung.offload_param == "cpu" and zero.offload_param is not None and zero.offload_param.pin_memory:
        pinned += [b.shard_size * low for b in buckets if not b.persistent]
    return sum(waste(n) for n in pinned)


def _gathered_unit_bytes(buckets, zero, low: int) -> int:
    """Stage 3's whole parameters during a step: the root unit throughout, layers up to the live limit.

    The gatherer keeps units for reuse while the gathered elements stay under
    `stage3_max_live_parameters`, prefetches within that limit, and always gathers the unit it
    needs now.
    """
    root = sum(b.padded_numel for b in buckets if b.unit == -1 and not b.persistent)
    per_unit: dict[int, int] = {}
    for b in buckets:
        if b.unit is not None and b.unit != -1 and not b.persistent:
            per_unit[b.unit] = per_unit.get(b.unit, 0) + b.padded_numel
    layers = sum(per_unit.values())
    largest = max(per_unit.values(), default=0)
    # Prefetch and reuse both stay under the live limit; only the unit needed now may exceed it.
    live = min(layers, max(zero.max_live_parameters, largest))
    return (root + live) * low


def _check_fit(est: RungEstimate, hardware: Hardware) -> None:
    checks = [("GPU", est.gpu_total + est.gpu_reserve, hardware.gpu_memory, est.gpu, "per GPU")]
    if hardware.cpu_memory is not None and est.cpu_total:  # a rung keeping nothing there adds nothing to check
        checks.append(("CPU", est.cpu_total + hardware.cpu_reserve, hardware.cpu_memory, est.cpu_per_node,
                       f"per node (with {format_bytes(hardware.cpu_reserve)} reserve)"))
    for what, need, have, terms, where in checks:
        if have is None or need <= have:
            continue
        term, size = max(terms.items(), key=lambda kv: kv[1])
        est.overflow.append(
            f"{what} needs {format_bytes(need)} {where} of {format_bytes(have)} "
            f"(over by {format_bytes(need - have)}; largest term: {term} {format_bytes(size)})"
        )
    if est.rung.uses_nvme and hardware.nvme_path is None:
        est.overflow.append("needs an NVMe path (--nvme)")
    est.fits = not est.overflow
