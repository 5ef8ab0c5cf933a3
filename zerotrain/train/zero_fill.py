"""The DeepSpeed section (``zero``) filled from the ``training`` settings, as the Hugging Face Trainer does.

A DeepSpeed file written for the Hugging Face Trainer says "auto" where the trainer should put
its own value.  `zerotrain train` does the same, and treats a key the DeepSpeed section leaves
out like "auto", so ``training`` is the one place to set these:

    zero key                              from training
    train_micro_batch_size_per_gpu        micro_batch_size
    gradient_accumulation_steps           gradient_accumulation_steps
    train_batch_size                      micro_batch_size x gradient_accumulation_steps x world size
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

A key set explicitly on both sides to different values is an error that lists every such
pair (as the Hugging Face Trainer reports them).  A key set only in ``zero`` wins, and
``training`` adopts its value (with a note), so the trainer's loop and the engine agree.
``train_batch_size`` is the exception: it depends on the world size, known only once the
processes run, so it is checked, never adopted.  The ZeRO bucket sizes ("auto") follow the
model's hidden size, filled by ``zerotrain.config.resolve_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from pydantic import ValidationError

from zerotrain.config.auto import resolve_config
from zerotrain.config.errors import AUTO, ConfigError, describe_validation_error, render_value
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.train.config import TrainConfig, TrainingSection, mark_user_set, validate_zero_section

SCHEDULE_TYPES = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}
# The parameters of each trainer schedule that training fills when the DeepSpeed section leaves them out.
SCHEDULE_FILLED_PARAMS = {
    "warmupcosinelr": ("total_num_steps", "warmup_num_steps", "cos_min_ratio"),
    "warmupdecaylr": ("total_num_steps", "warmup_num_steps", "warmup_max_lr"),
    "warmuplr": ("warmup_num_steps", "warmup_max_lr"),
}
ADAM_TYPES = ("adam", "adamw")
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")
_ABSENT = object()


@dataclass(frozen=True)
class Link:
    """A DeepSpeed key and the training setting it mirrors."""

    zero_key: str
    training_key: str
    to_zero: Callable[[Mapping[str, Any]], Any] | None = None
    """The training value in DeepSpeed's terms (None: it is not known yet); default: the value itself."""
    from_zero: Callable[[Any, Mapping[str, Any]], Any] | None = None
    """The DeepSpeed value in training's terms; default: the value itself."""
    user_keys: tuple[str, ...] = ()
    """Training keys whose being set by the user fixes this link; default: ``training_key``."""

    def training_value(self, values: Mapping[str, Any]) -> Any:
        return self.to_zero(values) if self.to_zero else values[self.training_key]

    def adopted(self, given: Any, values: Mapping[str, Any]) -> Any:
        return self.from_zero(given, values) if self.from_zero else given


LINKS: tuple[Link, ...] = (
    Link("train_micro_batch_size_per_gpu", "micro_batch_size"),
    Link("gradient_accumulation_steps", "gradient_accumulation_steps"),
    Link("gradient_clipping", "grad_clip"),
    Link("optimizer.params.lr", "lr"),
    Link("optimizer.params.betas", "betas", to_zero=lambda v: list(v["betas"])),
    Link("optimizer.params.eps", "eps"),
    Link("optimizer.params.weight_decay", "weight_decay"),
    Link("scheduler.params.warmup_max_lr", "lr"),
    Link("scheduler.params.warmup_num_steps", "warmup_steps", to_zero=lambda v: max(1, v["warmup_steps"])),
    Link(
        "scheduler.params.cos_min_ratio", "min_lr",
        to_zero=lambda v: v["min_lr"] / v["lr"], from_zero=lambda given, v: given * v["lr"],
    ),
    # With max_steps unset the step count comes from epochs and the data: compared in build_engine_config.
    Link("scheduler.params.total_num_steps", "max_steps", user_keys=("max_steps", "epochs")),
)


@dataclass
class _Reconciliation:
    """What comparing ``zero`` with ``training`` found."""

    adopted: dict[str, Any] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def adopt_deepspeed_values(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the training settings the DeepSpeed section sets (and training left unset) taken
    over; ConfigError listing every value set on both sides that disagrees.  Idempotent."""
    found = _reconcile(cfg.zero, cfg.training)
    if found.mismatches:
        raise _mismatch_error(found.mismatches, cfg.source)
    if not found.adopted:
        return cfg
    training = _training_with(cfg.training, found.adopted, cfg.source)
    result = cfg.model_copy(update={"training": training})
    result._notes = [*cfg.notes, *found.notes]
    return result


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
    mismatches = _world_mismatches(zero, t, world_size) + _steps_mismatches(zero, t, steps)
    if mismatches:
        raise _mismatch_error(mismatches, cfg.source)
    precision = resolve_precision(t.precision, device_type, zero)
    if zero.pop("activation_checkpointing", None) is not None:
        # DeepSpeed's section drives its own checkpointing API, which HF models never call; the trainer
        # turns on the model's gradient checkpointing instead (see wants_gradient_checkpointing).
        notes.append("zero.activation_checkpointing: applied as the model's gradient checkpointing (every layer, "
                     "non-reentrant); its partition/cpu/contiguous options do not apply")
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


def wants_gradient_checkpointing(cfg: TrainConfig) -> bool:
    """training.gradient_checkpointing, or an activation_checkpointing section in the DeepSpeed config."""
    return bool(cfg.training.gradient_checkpointing or "activation_checkpointing" in (cfg.zero or {}))


def resolve_precision(precision: str, device_type: str, zero: Mapping[str, Any] | None = None) -> str:
    """"fp32", "bf16" or "fp16": ``training.precision``, with "auto" following an fp16/bf16 the
    DeepSpeed section switches on, else bf16 on a CUDA GPU that supports it, else fp32."""
    if precision != "auto":
        return precision
    fp16, bf16 = _precision_switches(zero or {})
    if fp16 is True:
        return "fp16"
    if bf16 is True:
        return "bf16"
    on_bf16_gpu = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bf16" if on_bf16_gpu and bf16 is not False else "fp32"


# --------------------------------------------------------------------------- #
# comparing zero with training


def _reconcile(zero: Mapping[str, Any], training: TrainingSection) -> _Reconciliation:
    found = _Reconciliation()
    user_set = training.model_fields_set
    values = training.model_dump()
    adopted_from: dict[str, str] = {}
    for link in LINKS:
        given = _lookup(zero, link.zero_key)
        if given is _ABSENT or given == AUTO:
            continue
        key = link.training_key
        mine = link.training_value(values)
        if mine is not None and _same(given, mine):
            continue
        if key in adopted_from:
            # Two DeepSpeed keys stand for one training setting (optimizer lr, warmup_max_lr):
            # no single training value can match both.
            found.mismatches.append(
                f"zero.{link.zero_key} = {render_value(given)} but zero.{adopted_from[key]} = "
                f"{render_value(values[key])}, and both stand for training.{key}"
            )
        elif set(link.user_keys or (key,)) & user_set:
            if mine is not None:  # None: known only to the trainer (total steps from epochs)
                extra = "" if _same(mine, values[key]) else f" (= {render_value(mine)} in zero's terms)"
                ours = f"training.{key} = {render_value(values[key])}{extra}"
                found.mismatches.append(f"zero.{link.zero_key} = {render_value(given)} but {ours}")
        else:
            values[key] = found.adopted[key] = link.adopted(given, values)
            adopted_from[key] = link.zero_key
            found.notes.append(_adopted_note(key, values[key], link.zero_key))
    _reconcile_precision(zero, values, user_set, found)
    _reconcile_schedule_type(zero, values, user_set, found)
    return found


def _reconcile_precision(
    zero: Mapping[str, Any], values: dict[str, Any], user_set: set[str], found: _Reconciliation
) -> None:
    fp16, bf16 = _precision_switches(zero)
    switched_on = "fp16" if fp16 is True else "bf16" if bf16 is True else None
    switched_off = {mode for mode, on in (("fp16", fp16), ("bf16", bf16)) if on is False}
    precision = values["precision"]
    if precision == "auto":
        if switched_on:
            values["precision"] = found.adopted["precision"] = switched_on
            found.notes.append(_adopted_note("precision", switched_on, f"{switched_on}.enabled"))
        return
    if switched_on and switched_on != precision:
        found.mismatches.append(f"zero.{switched_on}.enabled = true but training.precision = {render_value(precision)}")
    if precision in switched_off:
        found.mismatches.append(f"zero.{precision}.enabled = false but training.precision = {render_value(precision)}")


def _reconcile_schedule_type(
    zero: Mapping[str, Any], values: dict[str, Any], user_set: set[str], found: _Reconciliation
) -> None:
    schedule = zero.get("scheduler")
    kind = schedule.get("type") if isinstance(schedule, Mapping) else None
    mine = SCHEDULE_TYPES[values["lr_schedule"]]
    if not isinstance(kind, str) or kind.lower() == mine.lower():
        return
    if "lr_schedule" in user_set:
        found.mismatches.append(
            f"zero.scheduler.type = {render_value(kind)} but training.lr_schedule = "
            f"{render_value(values['lr_schedule'])} (which is {mine})"
        )
        return
    by_type = {name.lower(): schedule_name for schedule_name, name in SCHEDULE_TYPES.items()}
    if kind.lower() in by_type:
        values["lr_schedule"] = found.adopted["lr_schedule"] = by_type[kind.lower()]
        found.notes.append(_adopted_note("lr_schedule", by_type[kind.lower()], "scheduler.type"))
    else:
        found.notes.append(
            f"zero.scheduler ({kind}) is used as written: training.lr_schedule, warmup_steps and min_lr do not apply"
        )


def _world_mismatches(zero: Mapping[str, Any], t: TrainingSection, world_size: int) -> list[str]:
    given = _lookup(zero, "train_batch_size")
    product = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    if given is _ABSENT or given == AUTO or given is None or given == product:
        return []
    return [
        f"zero.train_batch_size = {render_value(given)} but training.micro_batch_size {t.micro_batch_size} × "
        f"training.gradient_accumulation_steps {t.gradient_accumulation_steps} × world size {world_size} = {product}"
    ]


def _steps_mismatches(zero: Mapping[str, Any], t: TrainingSection, steps: int | None) -> list[str]:
    given = _lookup(zero, "scheduler.params.total_num_steps")
    if given is _ABSENT or given == AUTO or steps is None or given == steps:
        return []
    basis = f"training.max_steps = {t.max_steps}" if t.max_steps is not None else f"training.epochs = {t.epochs}"
    return [f"zero.scheduler.params.total_num_steps = {render_value(given)} but training runs {steps} steps ({basis})"]


def _mismatch_error(mismatches: list[str], origin: str | None) -> ConfigError:
    where = f" in {origin}" if origin else ""
    listed = "\n".join(f"  - {line}" for line in mismatches)
    return ConfigError(
        f"the DeepSpeed section (zero) and the training section disagree{where}:\n{listed}\n"
        'set each value in one place only (write "auto" in zero, or leave the training key out), or make them equal'
    )


def _training_with(training: TrainingSection, adopted: Mapping[str, Any], origin: str | None) -> TrainingSection:
    # Adopted values get the same checks as typed ones; model_fields_set keeps saying which
    # keys the user set (the adopted ones count as set from now on: both sides agree).
    try:
        result = TrainingSection.model_validate({**training.model_dump(), **adopted})
        mark_user_set(result, training.model_fields_set | set(adopted))
        return result
    except ValidationError as error:
        lines = describe_validation_error(error, TrainingSection).splitlines()
        where = f" in {origin}" if origin else ""
        details = "\n".join(f"  training.{line}" for line in lines)
        raise ConfigError(f"a value taken from the DeepSpeed section (zero) is not valid for training{where}:\n"
                          f"{details}") from None


# --------------------------------------------------------------------------- #
# filling


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
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world_size,
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


# --------------------------------------------------------------------------- #
# helpers


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    """The value at a dotted key, or _ABSENT."""
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def _precision_switches(zero: Mapping[str, Any]) -> tuple[Any, Any]:
    """(fp16.enabled, bf16.enabled) as written (bf16's old name bfloat16 included), _ABSENT if not."""
    bf16 = _lookup(zero, "bf16.enabled")
    if bf16 is _ABSENT:
        bf16 = _lookup(zero, "bfloat16.enabled")
    return _lookup(zero, "fp16.enabled"), bf16


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))  # 0.1 / 1e-3 * 1e-3 is not exactly 0.1
    return a == b


def _adopted_note(training_key: str, value: Any, zero_key: str) -> str:
    return (
        f"training.{training_key} = {render_value(value)}, taken from zero.{zero_key} "
        f"(training.{training_key} was not set)"
    )
