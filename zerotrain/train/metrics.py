"""Where a run's numbers go: the terminal, metrics.csv, TensorBoard and Weights & Biases.

Only rank 0 writes. Every rank reports its own memory, gathered at each logging
step, so the CSV answers "how much memory did it place on each GPU". The CSV is
appended to on resume, after dropping rows past the step the run resumed from,
so a resumed run's file reads as if it had never stopped.
"""

from __future__ import annotations

import csv
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TRAIN_FIELDS = [
    "step", "epoch", "loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
    "samples_per_s", "tokens_per_s", "tflops", "mfu", "elapsed_s",
]  # then mem_alloc_gb_r{R} and mem_peak_gb_r{R} for every rank
EVAL_FIELDS = ["step", "eval_loss", "eval_ppl", "elapsed_s"]

# Dense peak TFLOP/s per device for (16-bit, fp32/tf32) math; MFU is left blank for others.
PEAK_TFLOPS = {
    "H200": (989.0, 494.0),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10G": (70.0, 35.0),
    "L4": (121.0, 60.0),
    "V100": (125.0, 15.7),
}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak for the training dtype, when it is a known GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100"
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else single
    return None


def memory_of_this_rank(device: torch.device) -> tuple[float, float]:
    """(allocated, peak) in GiB: the CUDA caching allocator's figures, or the process RSS on a CPU."""
    gib = float(1 << 30)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / gib, torch.cuda.max_memory_allocated(device) / gib
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak_kib * (1 if sys.platform == "darwin" else 1024) / gib  # macOS reports bytes
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / gib
    except OSError:
        current = math.nan
    return current, peak


def gather_memory(device: torch.device) -> list[tuple[float, float]]:
    """Every rank's (allocated, peak) GiB, in rank order (a collective: all ranks call it)."""
    mine = memory_of_this_rank(device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


class MetricsLog:
    """Writes training and evaluation metrics from rank 0 to every enabled sink."""

    def __init__(self, section: Any, run_dir: Path, *, rank: int, world_size: int, resume_step: int, run_config: dict):
        self.enabled = rank == 0
        self.world_size = world_size
        self.train_fields = TRAIN_FIELDS + [
            f"mem_{kind}_gb_r{r}" for r in range(world_size) for kind in ("alloc", "peak")
        ]
        self.tensorboard = None
        self.wandb = None
        self.train_csv: _CsvFile | None = None
        self.eval_csv: _CsvFile | None = None
        if not self.enabled:
            return
        self.train_csv = _CsvFile(run_dir / "metrics.csv", self.train_fields, resume_step) if section.csv else None
        self.eval_csv = _CsvFile(run_dir / "eval.csv", EVAL_FIELDS, resume_step) if section.csv else None
        if section.tensorboard.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "logging.tensorboard.enabled needs the tensorboard package: pip install 'zerotrain[tensorboard]'"
                ) from None
            self.tensorboard = SummaryWriter(log_dir=str(section.tensorboard.dir or run_dir / "tensorboard"),
                                             purge_step=resume_step + 1 if resume_step else None)
        if section.wandb.enabled:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb.enabled needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(  # once, on rank 0 only
                project=section.wandb.project, name=section.wandb.name, mode=section.wandb.mode,
                dir=str(run_dir), config=run_config, resume="allow",
            )

    def log_train(self, row: dict[str, Any]) -> None:
        self._log("train", self.train_csv, row)

    def log_eval(self, row: dict[str, Any]) -> None:
        self._log("eval", self.eval_csv, row)

    def _log(self, prefix: str, csv_file: "_CsvFile | None", row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if csv_file is not None:
            csv_file.write(row)
        self._scalars(prefix, row)

    def _scalars(self, prefix: str, row: dict[str, Any]) -> None:
        step = row["step"]
        values = {
            f"{prefix}/{k}": float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
        }
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        for f in (self.train_csv, self.eval_csv):
            if f is not None:
                f.close()


class _CsvFile:
    """An append-mode CSV that first drops rows past `resume_step` (their steps run again)."""

    def __init__(self, path: Path, fields: list[str], resume_step: int) -> None:
        kept: list[dict] = []
        if path.exists() and resume_step > 0:
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= resume_step]
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
        self.writer.writeheader()
        for row in kept:
            self.writer.writerow(row)
        self.file.flush()

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow({k: _cell(v) for k, v in row.items()})
        self.file.flush()  # a run killed mid-way keeps every row logged so far

    def close(self) -> None:
        self.file.close()


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
