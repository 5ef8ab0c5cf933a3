"""The DeepSpeed section (``zero``) filled from the ``training`` settings, as the Hugging Face Trainer does.

A DeepSpeed file written for the Hugging Face Trainer says "auto" where the trainer should put
its own value.  `zerotrain train` does the same, and treats a key the DeepSpeed section leaves
out like "auto", so ``training`` is the one place to set these:

    zero key                              from training
    train_micro_batch_size_per_gpu        micro_batch_size
    gradient_accumulation_steps           gradient_accumulation_steps
    train_batch_size                      micro_batch_size x gradient_accumulation_steps x world size
                                          / sequence_parallel_size
    sequence_parallel_size                sequence_parallel_size
    gradient_clipping                     grad_clip
    optimizer (when absent)               AdamW
    optimizer.params.lr/betas/eps/weight_decay   lr / betas / eps / weight_decay
    scheduler (when absent)               lr_schedule: cosine WarmupCosineLR, linear WarmupDecayLR,
                                          constant WarmupLR (linear warmup over warmup_steps)
    scheduler.params.warmup_max_lr        lr
    scheduler.params.warmup_num_steps     max(1, warmup_steps)
    scheduler.params.cos_min_ratio        min_lr / lr
    scheduler.params.total_num_steps      the trainer's step count (max_steps, or from epochs)
    fp16.enabled / bf16.enabled           precision ("auto": bf16 on a GPU that supports it, else fp32)

How a key set on both sides, or only in ``zero``, is reconciled with ``training``: `zero_links.py`.  The ZeRO bucket sizes ("auto") follow the
model's hidden size, filled by ``zerotrain.config.resolve_config``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from zerotrain.config.auto import resolve_config
from zerotrain.config.errors import AUTO, ConfigError
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.train.config import TrainConfig, TrainingSection
from zerotrain.train.zero_section import validate_zero_section
from zerotrain.train.zero_links import (
    SCHEDULE_TYPES, adopt_deepspeed_values, mismatch_error, precision_switches, steps_mismatches, world_mismatches,
)

# The parameters of each trainer schedule that training fills when the DeepSpeed section leaves them out.
SCHEDULE_FILLED_PARAMS = {
    "warmupcosinelr": ("total_num_steps", "warmup_num_steps", "cos_min_ratio"),
    "warmupdecaylr": ("total_num_steps", "warmup_num_steps", "warmup_max_lr"),
    "warmuplr": ("warmup_num_steps", "warmup_max_lr"),
}


ADAM_TYPES = ("adam", "adamw")


ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")


def check_batch_at_world(cfg: TrainConfig, world_size: int) -> None:
    """ConfigError when the DeepSpeed section's train_batch_size cannot be what `training`'s batch sizes
    give at `world_size` processes: checked where the run is launched, before any rank starts."""
    mismatches = world_mismatches(cfg.zero_dict(), cfg.training, world_size)
    if mismatches:
        raise mismatch_error(mismatches, cfg.source)


def build_engine_config(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None,
    world_size: int,
    device_type: str,
    total_steps: int | None = None,
) -> tuple[ZeroTrainConfig, list[str]]:
    """The engine's config: ``cfg.zero`` plus an optimizer and schedule built from ``training`` where it
    has none, every "auto" (and every linked key it leaves out) filled from ``training``.

    ``total_steps``: the optimizer steps the trainer will run (default ``training.max_steps``).
    Returns the resolved config and notes for the user (values taken over from ``zero``, settings
    that do not apply).  Raises ConfigError listing every DeepSpeed value that disagrees with a
    training value the user set.
    """
    cfg = adopt_deepspeed_values(cfg)  # no-op after load_train_config; catches configs built in code
    t = cfg.training
    notes = cfg.notes
    zero = cfg.zero_dict()
    steps = total_steps if total_steps is not None else t.max_steps
    mismatches = world_mismatches(zero, t, world_size) + steps_mismatches(zero, t, steps)
    if mismatches:
        raise mismatch_error(mismatches, cfg.source)
    precision = resolve_precision(t.precision, device_type, zero)
    if zero.pop("activation_checkpointing", None) is not None:
        # DeepSpeed's section drives its own checkpointing API, which HF models never call; the trainer
        # turns on the model's gradient checkpointing instead (see wants_gradient_checkpointing).
        notes.append("zero.activation_checkpointing: applied as the model's gradient checkpointing (every layer, "
                     "non-reentrant); its cpu_checkpointing as training.offload_activations, its partition and "
                     "contiguous options do not apply")
    if t.sequence_parallel_size > 1:  # the engine builds the groups and wraps the attention
        zero["sequence_parallel_size"] = t.sequence_parallel_size
    _add_optimizer(zero)
    _add_scheduler(zero, t, notes)
    _treat_absent_as_auto(zero)
    # The trainer prints its own metrics every logging.interval; the engine's DeepSpeed-style
    # progress line would repeat them, so it stays quiet unless the DeepSpeed section asks for it.
    zero.setdefault("steps_per_print", 2**31 - 1)
    schedule = zero.get("scheduler") or {}
    if steps is None and (schedule.get("params") or {}).get("total_num_steps") == AUTO:
        raise ConfigError(
            "zero.scheduler.params.total_num_steps needs the number of training steps: pass total_steps "
            "(training.max_steps is not set)"
        )
    auto_values = _auto_values(t, world_size, precision, steps)
    engine = resolve_config(validate_zero_section(zero, cfg.source), world_size=world_size, model=model,
                            auto_values=auto_values)
    return engine, notes


def wants_gradient_checkpointing(cfg: TrainConfig) -> bool | str:
    """training.gradient_checkpointing (False, True or "selective"); True for an activation_checkpointing
    section in the DeepSpeed config, which asks for whole layers."""
    if cfg.training.gradient_checkpointing:
        return cfg.training.gradient_checkpointing
    return "activation_checkpointing" in (cfg.zero or {})


def wants_activation_offload(cfg: TrainConfig) -> bool:
    """training.offload_activations, or the DeepSpeed section's activation_checkpointing.cpu_checkpointing
    (DeepSpeed's switch for keeping checkpointed layers' inputs on the CPU). ConfigError when nothing is
    checkpointed: there would be nothing to offload."""
    section = (cfg.zero or {}).get("activation_checkpointing") or {}
    if cfg.training.offload_activations and not wants_gradient_checkpointing(cfg):
        raise ConfigError("training.offload_activations keeps the inputs of checkpointed layers on the CPU, and "
                          "training.gradient_checkpointing is false: set it to true (or selective), or remove "
                          "training.offload_activations")
    return cfg.training.offload_activations or bool(section.get("cpu_checkpointing"))


def resolve_precision(precision: str, device_type: str, zero: Mapping[str, Any] | None = None) -> str:
    """"fp32", "bf16" or "fp16": ``training.precision``, with "auto" following an fp16/bf16 the
    DeepSpeed section switches on, else bf16 on a CUDA GPU that supports it, else fp32."""
    if precision != "auto":
        return precision
    fp16, bf16 = precision_switches(zero or {})
    if fp16 is True:
        return "fp16"
    if bf16 is True:
        return "bf16"
    on_bf16_gpu = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bf16" if on_bf16_gpu and bf16 is not False else "fp32"


def _add_optimizer(zero: dict[str, Any]) -> None:
    """AdamW from training when zero has no optimizer; Adam-family params it leaves out become "auto"."""
    optimizer = zero.get("optimizer")
    if optimizer is None:
        zero["optimizer"] = {"type": "AdamW", "params": {key: AUTO for key in ADAM_PARAMS}}
        return
    if not isinstance(optimizer, dict):
        return  # validation reports it
    params = optimizer.setdefault("params", {})
    filled = ADAM_PARAMS if str(optimizer.get("type", "")).lower() in ADAM_TYPES else ("lr",)
    if isinstance(params, dict):
        for key in filled:
            params.setdefault(key, AUTO)


def _add_scheduler(zero: dict[str, Any], t: TrainingSection, notes: list[str]) -> None:
    """The schedule training describes when zero has none; known schedule params it leaves out become "auto"."""
    schedule = zero.get("scheduler")
    if schedule is None:
        zero["scheduler"] = _schedule_from_training(t)
        if t.lr_schedule == "linear" and t.min_lr > 0:
            notes.append(f"training.min_lr = {t.min_lr} does not apply to the linear schedule (it decays to 0)")
        return
    if not isinstance(schedule, dict):
        return
    params = schedule.setdefault("params", {})
    if isinstance(params, dict):
        for key in SCHEDULE_FILLED_PARAMS.get(str(schedule.get("type", "")).lower(), ()):
            params.setdefault(key, AUTO)


def _schedule_from_training(t: TrainingSection) -> dict[str, Any]:
    # Linear warmup, as the Hugging Face Trainer does (DeepSpeed's default is logarithmic).
    # DeepSpeed's schedules warm up over at least 2 steps; with no warmup asked for, cosine and
    # constant start at the full lr instead (warmup from lr to lr).
    warmup = {"warmup_num_steps": AUTO, "warmup_type": "linear"}
    if t.lr_schedule == "cosine":
        start = 1.0 if t.warmup_steps == 0 else 0.0
        params = {"total_num_steps": AUTO, **warmup, "warmup_min_ratio": start, "cos_min_ratio": AUTO}
    elif t.lr_schedule == "linear":
        params = {"total_num_steps": AUTO, **warmup, "warmup_min_lr": 0.0, "warmup_max_lr": AUTO}
    else:
        start_lr = t.lr if t.warmup_steps == 0 else 0.0
        params = {**warmup, "warmup_min_lr": start_lr, "warmup_max_lr": AUTO}
    return {"type": SCHEDULE_TYPES[t.lr_schedule], "params": params}


def _treat_absent_as_auto(zero: dict[str, Any]) -> None:
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping"):
        if zero.get(key) is None:
            zero[key] = AUTO
    for section in ("fp16", "bfloat16" if "bfloat16" in zero else "bf16"):
        if zero.get(section) is None:
            zero[section] = {}
        if isinstance(zero[section], dict):
            zero[section].setdefault("enabled", AUTO)


def _auto_values(t: TrainingSection, world_size: int, precision: str, steps: int | None) -> dict[str, Any]:
    """Every dotted DeepSpeed key training can fill, with its value (used only where zero says "auto")."""
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        # N ranks of a sequence-parallel group train one sample: the batch counts groups.
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps
        * (world_size // t.sequence_parallel_size),
        "gradient_clipping": t.grad_clip,
        "optimizer.params.lr": t.lr,
        "optimizer.params.betas": list(t.betas),
        "optimizer.params.eps": t.eps,
        "optimizer.params.weight_decay": t.weight_decay,
        "scheduler.params.warmup_max_lr": t.lr,
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_num_steps": max(1, t.warmup_steps),
        "scheduler.params.warmup_min_ratio": 0.0,
        "scheduler.params.warmup_type": "linear",
        "scheduler.params.cos_min_ratio": t.min_lr / t.lr,
        "fp16.enabled": precision == "fp16",
        "bf16.enabled": precision == "bf16",
    }
    if steps is not None:
        values["scheduler.params.total_num_steps"] = steps
    return values
