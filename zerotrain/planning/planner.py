"""The plan: the guides' nine-step procedure, walked on the memory model instead of on failed runs.

Every rung of the ladder gets the largest micro-batch that divides the per-GPU share of the
global batch and fits, with accumulation making up the global batch. With the hardware's speeds
(`Rates`) each fitting rung's step is timed by the step-time model and the fastest is the plan;
every rung predicted faster that does not fit is kept with the reason (at micro-batch 1). Without
speeds, the first rung that fits in ladder order is the plan. The minimum GPU counts answer "do I
need several GPUs for this model?".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from zerotrain.planning.hardware_rates import Rates
from zerotrain.planning.ladder import Rung, ladder
from zerotrain.planning.rung_memory import Hardware, RungEstimate, Workload, estimate_rung, rung_config
from zerotrain.planning.step_time import StepTime, predict_step

# The search for a minimum GPU count stops here: beyond it, activations at micro-batch 1 are the
# problem, and more data-parallel ranks do not shrink them.
MAX_GPUS = 16384
TIE = 0.03
"""Predicted steps closer than this fraction count as equally fast (the model's resolution)."""


@dataclass
class Plan:
    """What `plan` recommends, and why nothing faster."""

    choice: RungEstimate | None
    """The fastest rung that fits, at its micro-batch; None when nothing fits."""
    accumulation: int
    """Gradient accumulation steps that keep the global batch with `choice.micro_batch`."""
    global_batch: int
    rejected: list[RungEstimate] = field(default_factory=list)
    """Each faster rung, estimated at micro-batch 1, with its overflow reasons."""
    min_gpus_without_offload: int | None = None
    min_gpus_with_offload: int | None = None
    hardware: Hardware | None = None
    workload: Workload | None = None
    verification: list[dict] = field(default_factory=list)
    """`--verify`'s runs: per rung tried, measured and predicted bytes and whether it fit."""
    timings: list[tuple[RungEstimate, StepTime]] = field(default_factory=list)
    """With speeds: every rung's estimate (at its largest fitting micro-batch, else 1) and predicted step."""
    rates: Rates | None = None

    @property
    def choice_time(self) -> StepTime | None:
        return next((t for e, t in self.timings if e is self.choice), None)

    def why(self) -> str | None:
        """Why the choice wins, in words: against the fastest rung that would beat it but does not fit,
        or against the runner-up."""
        chosen = self.choice_time
        if chosen is None:
            return None
        faster = [(e, t) for e, t in self.timings if not e.fits and t.step_s < chosen.step_s]
        if faster:
            e, t = min(faster, key=lambda et: et[1].step_s)
            return (f"{self.choice.rung.name}: {chosen.step_s / t.step_s - 1:.0%} slower than {e.rung.name} would be, "
                    f"but {e.rung.name} does not fit")
        others = sorted((t.step_s, e.rung.name) for e, t in self.timings if e.fits and e is not self.choice)
        if not others:
            return f"{self.choice.rung.name}: the only rung that fits"
        return (f"{self.choice.rung.name}: the fastest that fits; next is {others[0][1]}, "
                f"{others[0][0] / chosen.step_s - 1:.0%} slower")

    def deepspeed_config(self, base_config: dict | None = None) -> dict[str, Any]:
        """The chosen rung as a DeepSpeed JSON config (batch sizes explicit, "auto" nowhere in ZeRO)."""
        if self.choice is None:
            raise ValueError("nothing fits: there is no config to write")
        assert self.workload is not None and self.hardware is not None
        cfg = rung_config(self.choice.rung, self.workload_at_choice(), base_config, self.hardware.nvme_path)
        cfg["gradient_accumulation_steps"] = self.accumulation
        cfg["train_batch_size"] = self.global_batch
        return cfg  # checkpointing has no DeepSpeed key for a Hugging Face model: the plan says it in words

    def workload_at_choice(self) -> Workload:
        assert self.workload is not None and self.choice is not None
        w = self.workload
        return replace(w, micro_batch=self.choice.micro_batch)


def make_plan(
    model: nn.Module,
    hardware: Hardware,
    seq_len: int,
    global_batch: int,
    dtype: str = "bf16",
    attention: str = "sdpa",
    base_config: dict | None = None,
    checkpointing: bool | None = None,
    exclude: frozenset[Rung] = frozenset(),
    rates: Rates | None = None,
    loss_chunk_tokens: int | None = None,
) -> Plan:
    """The fastest rung of the ladder that fits `hardware`, with micro-batch and accumulation.

    `rates`: the hardware's speeds; with them the fastest is the one the step-time model
    predicts fastest, without them the first that fits in ladder order.
    `exclude` leaves rungs out (ones a verification run showed do not fit).
    `loss_chunk_tokens`: zerotrain train's chunked loss (one chunk's logits at most), for every rung.
    Raises ValueError when the global batch does not split evenly over the GPUs.
    """
    world = hardware.world_size
    if global_batch < world or global_batch % world:
        raise ValueError(
            f"--global-batch {global_batch} does not split over {world} GPUs; use a multiple of {world}"
        )
    per_gpu = global_batch // world
    micro_batches = [m for m in range(per_gpu, 0, -1) if per_gpu % m == 0]
    work = Workload(seq_len, 1, dtype, attention, loss_chunk_tokens)
    result = Plan(None, 0, global_batch, hardware=hardware, workload=work, rates=rates)
    flops = None
    for rung in ladder(allow_nvme=hardware.nvme_path is not None, checkpointing=checkpointing):
        if rung in exclude:
            continue
        best = _largest_fitting(model, rung, micro_batches, hardware, work, base_config)
        if rates is None:
            if best is not None:
                result.choice, result.accumulation = best, per_gpu // best.micro_batch
                break
            result.rejected.append(estimate_rung(model, rung, work, hardware, base_config))
            continue
        estimate = best or estimate_rung(model, rung, work, hardware, base_config)
        if flops is None:
            from zerotrain.planning.model_flops import model_flops

            flops = model_flops(model, seq_len)
        step = predict_step(model, rung, replace(work, micro_batch=estimate.micro_batch), hardware, rates,
                            per_gpu // estimate.micro_batch, base_config, flops)
        result.timings.append((estimate, step))
    if rates is not None:
        fitting = [(e, t) for e, t in result.timings if e.fits]
        if fitting:
            # Within TIE of the fastest is within the model's error: the earlier rung of the ladder (fewer
            # moving parts: no per-unit gathers, no host copies) is the better bet.
            fastest = min(t.step_s for _, t in fitting)
            result.choice = next(e for e, t in fitting if t.step_s <= fastest * (1 + TIE))
            result.accumulation = per_gpu // result.choice.micro_batch
        bar = result.choice_time.step_s if result.choice else float("inf")
        result.rejected = [e for e, t in result.timings if not e.fits and t.step_s < bar]
    # The leanest rung is not always stage 3: on few GPUs its gathered units outweigh what it shards.
    leanest = [r for r in ladder(allow_nvme=False, checkpointing=True)]
    result.min_gpus_without_offload = _fewest(
        min_gpus(model, r, work, hardware, base_config) for r in leanest if r.offload_optimizer == "none")
    result.min_gpus_with_offload = _fewest(
        min_gpus(model, r, work, hardware, base_config) for r in leanest if r.offload_optimizer != "none")
    return result


def _fewest(counts) -> int | None:
    found = [c for c in counts if c is not None]
    return min(found) if found else None


def _largest_fitting(model, rung: Rung, micro_batches: list[int], hardware: Hardware, work: Workload,
                     base_config) -> RungEstimate | None:
    # Memory grows with the micro-batch: test the smallest first, then bisect for the largest.
    def estimate(m: int) -> RungEstimate:
        return estimate_rung(model, rung, replace(work, micro_batch=m), hardware, base_config)

    smallest = estimate(micro_batches[-1])
    if not smallest.fits:
        return None
    lo, hi = len(micro_batches) - 1, 0  # indices: micro_batches is descending; lo fits
    best = smallest
    while hi < lo:
        mid = (lo + hi) // 2
        e = estimate(micro_batches[mid])
        if e.fits:
            best, lo = e, mid
        else:
            hi = mid + 1
    return best


def min_gpus(model: nn.Module, rung: Rung, workload: Workload, hardware: Hardware,
             base_config: dict | None = None) -> int | None:
    """The fewest GPUs (of `hardware`'s kind) on which `rung` fits at `workload`; None past MAX_GPUS.

    Counts below one node use one node's GPUs; above it, whole nodes. Memory per GPU falls as
    GPUs are added (shards shrink), so the count is found by bisection.
    """
    per_node = hardware.gpus_per_node
    counts = list(range(1, per_node + 1)) + [per_node * n for n in range(2, MAX_GPUS // per_node + 1)]

    def fits(count: int) -> bool:
        nodes = max(1, math.ceil(count / per_node))
        hw = Hardware(min(count, per_node), nodes, hardware.gpu_memory, hardware.cpu_memory, hardware.nvme_path)
        return estimate_rung(model, rung, workload, hw, base_config).fits

    if not fits(counts[-1]):
        return None
    lo, hi = 0, len(counts) - 1  # hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return counts[hi]
