"""Which DeepSpeed key mirrors which ``training`` setting, and how the two sides are reconciled.

A key set explicitly on both sides to different values is an error that lists every such
pair (as the Hugging Face Trainer reports them).  A key set only in ``zero`` wins, and
``training`` adopts its value (with a note), so the trainer's loop and the engine agree.
``train_batch_size`` is the exception: it depends on the world size, known only once the
processes run, so it is checked (`world_mismatches`), never adopted.  Filling what is left
"auto" is `zero_fill.py`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from zerotrain.config.errors import AUTO, ConfigError, describe_validation_error, render_value
from zerotrain.train.config import TrainConfig, TrainingSection, mark_user_set

SCHEDULE_TYPES = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}


ABSENT = object()


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
    Link("sequence_parallel_size", "sequence_parallel_size"),
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
        raise mismatch_error(found.mismatches, cfg.source)
    if not found.adopted:
        return cfg
    training = _training_with(cfg.training, found.adopted, cfg.source)
    result = cfg.model_copy(update={"training": training})
    result._notes = [*cfg.notes, *found.notes]
    return result


def _reconcile(zero: Mapping[str, Any], training: TrainingSection) -> _Reconciliation:
    found = _Reconciliation()
    user_set = training.model_fields_set
    values = training.model_dump()
    adopted_from: dict[str, str] = {}
    for link in LINKS:
        given = lookup(zero, link.zero_key)
        if given is ABSENT or given == AUTO:
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
    fp16, bf16 = precision_switches(zero)
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


def world_mismatches(zero: Mapping[str, Any], t: TrainingSection, world_size: int) -> list[str]:
    given = lookup(zero, "train_batch_size")
    groups = world_size // t.sequence_parallel_size  # N ranks share each sample (sequence parallelism)
    product = t.micro_batch_size * t.gradient_accumulation_steps * groups
    if given is ABSENT or given == AUTO or given is None or given == product:
        return []
    width = f"world size {world_size}" if groups == world_size else (
        f"sequence groups {groups} (world size {world_size} / training.sequence_parallel_size {t.sequence_parallel_size})")
    return [
        f"zero.train_batch_size = {render_value(given)} but training.micro_batch_size {t.micro_batch_size} × "
        f"training.gradient_accumulation_steps {t.gradient_accumulation_steps} × {width} = {product}"
    ]


def steps_mismatches(zero: Mapping[str, Any], t: TrainingSection, steps: int | None) -> list[str]:
    given = lookup(zero, "scheduler.params.total_num_steps")
    if given is ABSENT or given == AUTO or steps is None or given == steps:
        return []
    basis = f"training.max_steps = {t.max_steps}" if t.max_steps is not None else f"training.epochs = {t.epochs}"
    return [f"zero.scheduler.params.total_num_steps = {render_value(given)} but training runs {steps} steps ({basis})"]


def mismatch_error(mismatches: list[str], origin: str | None) -> ConfigError:
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


def lookup(data: Mapping[str, Any], dotted: str) -> Any:
    """The value at a dotted key, or ABSENT."""
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return ABSENT
        node = node[key]
    return node


def precision_switches(zero: Mapping[str, Any]) -> tuple[Any, Any]:
    """(fp16.enabled, bf16.enabled) as written (bf16's old name bfloat16 included), ABSENT if not."""
    bf16 = lookup(zero, "bf16.enabled")
    if bf16 is ABSENT:
        bf16 = lookup(zero, "bfloat16.enabled")
    return lookup(zero, "fp16.enabled"), bf16


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
