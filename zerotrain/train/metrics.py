"""Where a run's numbers go: the terminal, metrics.csv, TensorBoard and Weights & Biases.

Only rank 0 writes. Every rank reports its own memory, gathered at each logging
step, so the CSV answers "how much memory did it place on each GPU": what the
process holds (the CUDA allocator's figures, or RSS on a CPU) and, beside it, the
model states ZeRO partitions (parameters, gradients, optimizer states and buffers,
measured from the tensors), which show what each stage saves. The CSV is
appended to on resume, after dropping rows past the step the run resumed from,
so a resumed run's file reads as if it had never stopped.
"""

from __future__ import annotations

import csv
import math
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


TRAIN_FIELDS = [
    "step", "epoch", "loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
    "samples_per_s", "tokens_per_s", "tflops", "mfu", "elapsed_s",
]  # then the MEMORY_KINDS columns of every rank: mem_alloc_gb_r0, mem_peak_gb_r0, ..., mem_alloc_gb_r1, ...
# Per rank, GiB: the process (allocated now, peak) and the model states it holds.
MEMORY_KINDS = ("alloc", "peak", "params", "grads", "optim", "buffers", "model_states")
EVAL_FIELDS = ["step", "eval_loss", "eval_ppl", "elapsed_s"]
# Written to the last bit (the rest to 6 digits): a resumed run is checked against an uninterrupted one by them.
EXACT_FIELDS = {"loss", "eval_loss"}

_GIB = float(1 << 30)
# This process's highest reading so far, per device type: the peak reported never falls below a current one.
_peak_seen: dict[str, float] = {}


def memory_of_this_rank(device: torch.device) -> tuple[float, float]:
    """(allocated, peak) in GiB: the CUDA caching allocator's figures, or the process RSS on a CPU.

    On a CPU the two come from different counters read at different moments (current RSS
    from /proc/self/statm, the peak from getrusage), so the peak is raised to at least the
    current figure and to every earlier reading: a report never shows current above peak.
    """
    if device.type == "cuda":
        current = torch.cuda.memory_allocated(device) / _GIB
        peak = torch.cuda.max_memory_allocated(device) / _GIB
    else:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak_kib * (1 if sys.platform == "darwin" else 1024) / _GIB  # macOS reports bytes
        try:
            with open("/proc/self/statm") as f:
                current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _GIB
        except OSError:
            current = math.nan
    if not math.isnan(current):
        peak = max(peak, current)
    _peak_seen[device.type] = max(_peak_seen.get(device.type, 0.0), peak)
    return current, _peak_seen[device.type]


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of model states this rank holds now: params, grads, optim (fp32 masters and
    optimizer state) and buffers, from `engine.memory_breakdown()` plus the module's buffers."""
    held = engine.memory_breakdown()
    storages: dict[int, int] = {}  # buffers may share storage (a view registered twice): count it once
    for buffer in engine.module.buffers():
        if buffer.device.type != "meta":
            storage = buffer.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {
        "params": held.get("params", 0),
        "grads": held.get("grads", 0),
        "optim": held.get("master", 0) + held.get("optimizer_state", 0) + held.get("optimizer_scalars", 0),
        "buffers": sum(storages.values()),
    }


@dataclass
class RankMemory:
    """One rank's memory at a logging step, in GiB."""

    alloc: float
    peak: float
    params: float = math.nan
    grads: float = math.nan
    optim: float = math.nan
    buffers: float = math.nan

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optim + self.buffers

    def columns(self, rank: int) -> dict[str, float]:
        """This rank's metrics.csv cells (`mem_<kind>_gb_r<rank>`)."""
        return {f"mem_{kind}_gb_r{rank}": getattr(self, kind) for kind in MEMORY_KINDS}


def gather_memory(device: torch.device, engine: Any = None) -> list[RankMemory]:
    """Every rank's memory, in rank order (a collective: all ranks call it, once per logging step).

    Without an engine only the process figures are filled in.
    """
    alloc, peak = memory_of_this_rank(device)
    states = {k: v / _GIB for k, v in model_state_bytes(engine).items()} if engine is not None else {}
    mine = RankMemory(alloc, peak, **states)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def describe_memory(memory: list[RankMemory], device_type: str) -> str:
    """The terminal's memory summary: per rank, the model states held, then the process's now/peak."""
    process = "alloc" if device_type == "cuda" else "RSS"
    return "; ".join(
        f"r{r} model states {_size(m.model_states)}, {process} now {m.alloc:.2f} peak {m.peak:.2f} GiB"
        for r, m in enumerate(memory)
    )


def _size(gib: float) -> str:
    if math.isnan(gib):
        return "-"
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


# The package each optional sink needs, and the command that installs it.
SINK_PACKAGES = {
    "logging.tensorboard.enabled": ("torch.utils.tensorboard", "pip install 'zerotrain[tensorboard]'"),
    "logging.wandb.enabled": ("wandb", "pip install wandb"),
}


def check_sink_packages(section: Any) -> None:
    """Raises ConfigError, naming the key and the pip command, when an enabled sink's package is missing.

    Cheap to call early (before the model is built): it imports only the enabled sinks' packages.
    """
    enabled = {"logging.tensorboard.enabled": section.tensorboard.enabled,
               "logging.wandb.enabled": section.wandb.enabled}
    for key, on in enabled.items():
        if on:
            _import_sink(key, SINK_PACKAGES[key][0])


def _import_sink(key: str, module: str, attribute: str | None = None) -> Any:
    import importlib

    from zerotrain.config.errors import ConfigError

    try:
        imported = importlib.import_module(module)
        return getattr(imported, attribute) if attribute else imported
    except ImportError as error:
        command = SINK_PACKAGES[key][1]
        raise ConfigError(
            f"{key} is true but {module} cannot be imported ({error}): install it with `{command}`, "
            f"or set {key}: false"
        ) from None


class MetricsLog:
    """Writes training and evaluation metrics from rank 0 to every enabled sink."""

    def __init__(self, section: Any, run_dir: Path, *, rank: int, world_size: int, resume_step: int, run_config: dict):
        self.enabled = rank == 0
        self.world_size = world_size
        self.train_fields = TRAIN_FIELDS + [f"mem_{kind}_gb_r{r}" for r in range(world_size) for kind in MEMORY_KINDS]
        self.tensorboard = None
        self.wandb = None
        self.train_csv: _CsvFile | None = None
        self.eval_csv: _CsvFile | None = None
        check_sink_packages(section)  # on every rank, so all of them stop, not only rank 0
        if not self.enabled:
            return
        self.train_csv = _CsvFile(run_dir / "metrics.csv", self.train_fields, resume_step) if section.csv else None
        self.eval_csv = _CsvFile(run_dir / "eval.csv", EVAL_FIELDS, resume_step) if section.csv else None
        if section.tensorboard.enabled:
            SummaryWriter = _import_sink("logging.tensorboard.enabled", "torch.utils.tensorboard", "SummaryWriter")
            self.tensorboard = SummaryWriter(log_dir=str(section.tensorboard.dir or run_dir / "tensorboard"),
                                             purge_step=resume_step + 1 if resume_step else None)
        if section.wandb.enabled:
            wandb = _import_sink("logging.wandb.enabled", "wandb")
            self.wandb = wandb.init(  # once, on rank 0 only
                project=section.wandb.project, name=section.wandb.name, mode=section.wandb.mode,
                dir=str(run_dir), config=run_config, resume="allow",
            )

    def log_train(self, row: dict[str, Any]) -> None:
        self._log("train", self.train_csv, row)

    def log_eval(self, row: dict[str, Any]) -> None:
        self._log("eval", self.eval_csv, row)

    def earlier_eval(self) -> dict[str, Any]:
        """The newest evaluation a resumed run's earlier segments logged (eval.csv), as the summary
        shows it; empty on a fresh run, without CSV logging, or on ranks other than 0."""
        row = self.eval_csv.last_kept if self.eval_csv is not None else None
        if not row:
            return {}
        return {"eval_step": int(row["step"]), "eval_loss": float(row["eval_loss"]), "eval_ppl": float(row["eval_ppl"])}

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
        self.last_kept = kept[-1] if kept else None  # an earlier segment's newest row, for the summary
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
        self.writer.writeheader()
        for row in kept:
            self.writer.writerow(row)
        self.file.flush()

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow({k: repr(v) if k in EXACT_FIELDS and isinstance(v, float) else _cell(v)
                              for k, v in row.items()})
        self.file.flush()  # a run killed mid-way keeps every row logged so far

    def close(self) -> None:
        self.file.close()


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value
