"""The autotuner's experiments: ladder rungs x micro-batches (x bucket sizes), pruned by the memory model.

Order is the plan's: rungs fastest first (`ladder`), and within a rung the largest micro-batch
first (fewer accumulation steps); every experiment keeps the global batch through accumulation.
A rung the memory model says does not fit is pruned before any trial runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotrain.planning.ladder import Rung, ladder
from zerotrain.planning.rung_memory import Hardware, Workload, estimate_rung, rung_config

# With `fast: false` the reduce bucket is also tried at these sizes (elements).
BUCKET_SIZES = (50_000_000, 500_000_000)


@dataclass(frozen=True)
class Experiment:
    """One configuration to time."""

    name: str
    rung: Rung
    micro_batch: int
    accumulation: int
    reduce_bucket_size: int | None = None
    predicted_gpu_bytes: int = 0

    def deepspeed_config(self, base: dict[str, Any], seq_len: int, dtype: str, global_batch: int) -> dict[str, Any]:
        cfg = rung_config(self.rung, Workload(seq_len, self.micro_batch, dtype), base)
        cfg["gradient_accumulation_steps"] = self.accumulation
        cfg["train_batch_size"] = global_batch
        cfg.pop("autotuning", None)
        cfg.pop("flops_profiler", None)
        if self.reduce_bucket_size is not None:
            cfg["zero_optimization"]["reduce_bucket_size"] = self.reduce_bucket_size
        return cfg


@dataclass(frozen=True)
class Pruned:
    """A candidate the memory model ruled out, and why."""

    name: str
    reason: str


def experiments(model, hardware: Hardware, seq_len: int, global_batch: int, dtype: str, base: dict[str, Any],
                fast: bool = True, max_micro_batch: int | None = None) -> tuple[list[Experiment], list[Pruned]]:
    """Candidates in trial order, and those pruned before any trial."""
    world = hardware.world_size
    if global_batch % world:
        raise ValueError(f"the global batch {global_batch} does not split over {world} ranks")
    per_rank = global_batch // world
    micros = [m for m in range(per_rank, 0, -1) if per_rank % m == 0 and (max_micro_batch is None or m <= max_micro_batch)]
    buckets: tuple[int | None, ...] = (None,) if fast else BUCKET_SIZES
    kept: list[Experiment] = []
    pruned: list[Pruned] = []
    for rung in ladder(allow_nvme=False):
        for micro in micros:
            est = estimate_rung(model, rung, Workload(seq_len, micro, dtype), hardware, base)
            for bucket in buckets:
                if bucket is not None and rung.stage == 0:
                    continue  # stage 0 reduces whole gradients: the bucket size changes nothing
                name = f"z{rung.stage}_{_offload_tag(rung)}mbs{micro}" + (f"_rbs{bucket:.0e}" if bucket else "")
                name = name.replace("+", "")
                if not est.fits:
                    pruned.append(Pruned(name, "; ".join(est.overflow)))
                    continue
                kept.append(Experiment(name, rung, micro, per_rank // micro, bucket, est.gpu_total))
    return kept, pruned


def _offload_tag(rung: Rung) -> str:
    tag = ""
    if rung.offload_optimizer != "none":
        tag += f"oo{rung.offload_optimizer}_"
    if rung.offload_param != "none":
        tag += f"op{rung.offload_param}_"
    if rung.gradient_checkpointing == "selective":
        tag += "sac_"
    elif rung.gradient_checkpointing:
        tag += "ckpt_"
    return tag
