"""Filling in "auto" values and working out the three batch sizes.

DeepSpeed files written for the Hugging Face Trainer say "auto" wherever the
trainer is expected to fill a value.  ``resolve_config`` fills them from, in
order: the ``auto_values`` a caller passes (a later ``zerotrain train`` fills
them from its arguments), rules that need only the model, and DeepSpeed's own
defaults.  A value none of these can supply is an error naming its key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import ValidationError

from zerotrain.config.errors import AUTO, ConfigError, describe_validation_error, format_problems, render_value
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.unsupported import check_supported

if TYPE_CHECKING:  # a model comes with torch loaded; without one (`zerotrain config check`) torch is not needed
    import torch

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# Optimizer keyword arguments with a safe default when "auto" (the Hugging Face
# Trainer's defaults).  lr has none on purpose: guessing a learning rate hides a
# missing setting.
OPTIMIZER_PARAM_DEFAULTS: dict[str, Any] = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}

# Hidden-size rules for ZeRO buffer sizes, as the Hugging Face integration sets them.
HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


class BatchSizeMismatch(ConfigError):
    """train_batch_size is not micro-batch x accumulation x the data-parallel width (callers add what
    their users set to fix it)."""


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[int, int, int]:
    """Complete (train_batch_size, train_micro_batch_size_per_gpu,
    gradient_accumulation_steps) so that train = micro x gas x world_size.

    Missing values (None) are inferred as DeepSpeed does: gas from train and
    micro, micro from train and gas, train from micro and gas; with only train
    or only micro given, gas is 1.  Raises ConfigError showing the numbers when
    they do not multiply out exactly or one is not positive.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    train, micro, gas = (_as_batch_int(name, value) for name, value in zip(BATCH_KEYS, (train, micro, gas)))
    if train is None and micro is None:
        raise ConfigError(
            "train_micro_batch_size_per_gpu is not set (nor is train_batch_size): "
            "set train_micro_batch_size_per_gpu in the config"
        )
    if train is not None and micro is not None and gas is None:
        gas = train // (micro * world_size)
    elif train is not None and gas is not None and micro is None:
        micro = train // world_size // gas if gas > 0 else 0
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * world_size
    elif train is not None and micro is None:
        gas, micro = 1, train // world_size
    elif micro is not None and train is None:
        gas, train = 1, micro * world_size

    assert train is not None and micro is not None and gas is not None
    numbers = (
        f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} × "
        f"gradient_accumulation_steps {gas} × world size {world_size} = {micro * gas * world_size}"
    )
    not_positive = [name for name, value in zip(BATCH_KEYS, (train, micro, gas)) if value < 1]
    if not_positive:
        raise ConfigError(
            f"{' and '.join(not_positive)} must be positive; with world size {world_size} the batch sizes "
            f"work out to train_batch_size {train}, train_micro_batch_size_per_gpu {micro}, "
            f"gradient_accumulation_steps {gas}: choose values with train = micro × accumulation × world size"
        )
    if train != micro * gas * world_size:
        raise BatchSizeMismatch(f"batch sizes do not multiply out: {numbers}")
    return train, micro, gas


def _as_batch_int(name: str, value: Any) -> int | None:
    # Values arrive from auto_values and command lines too, not only the schema.
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: got {render_value(value)}, expected a positive integer")
    return value


def sequence_groups_count(sequence_parallel_size: int, world_size: int) -> int:
    """World size / sequence_parallel_size: the data-parallel width the batch sizes count.
    A ConfigError when the size does not divide the world."""
    if world_size % sequence_parallel_size:
        sizes = [n for n in range(1, world_size + 1) if world_size % n == 0]
        raise ConfigError(
            f"sequence_parallel_size {sequence_parallel_size} does not divide the world size {world_size}: "
            f"each sequence-parallel group is that many consecutive ranks. Use one of {sizes}, "
            f"or a world size that is a multiple of {sequence_parallel_size}"
        )
    return world_size // sequence_parallel_size


def resolve_config(
    cfg: ZeroTrainConfig,
    *,
    world_size: int,
    model: torch.nn.Module | None = None,
    auto_values: Mapping[str, Any] | None = None,
) -> ZeroTrainConfig:
    """Return a copy of ``cfg`` with every "auto" filled and the batch sizes worked out.

    ``auto_values`` maps dotted keys ("optimizer.params.lr",
    "train_micro_batch_size_per_gpu", ...) to the value to use where the config
    says "auto"; keys the config does not set to "auto" are ignored.  ``model``
    feeds the rules that need the parameter dtype or ``model.config.hidden_size``.
    Unsupported features are refused first (``check_supported``), so a user
    learns that before being asked to fill in values.  All remaining problems
    are reported together in one ConfigError.
    """
    check_supported(cfg)
    filler = _AutoFiller(cfg, model, dict(auto_values or {}))
    # With sequence parallelism N ranks train one sample: batch sizes count world / N (as DeepSpeed).
    data = filler.fill(sequence_groups_count(cfg.sequence_parallel_size, world_size))
    for path in _autos_left(data):
        if path not in filler.reported:
            filler.report(path, f'{path} is "auto" and zerotrain has no rule to fill it: set a value')
    if filler.problems:
        raise ConfigError(format_problems("cannot resolve the config:", filler.problems))
    try:
        resolved = ZeroTrainConfig.model_validate(data)
    except ValidationError as error:
        details = describe_validation_error(error, ZeroTrainConfig).replace("\n", "\n  ")
        raise ConfigError(f"a value filled in for \"auto\" (from auto_values) is invalid:\n  {details}") from None
    check_supported(resolved)
    return resolved


class _AutoFiller:
    """Applies the "auto" rules to a plain-dict copy of a config, collecting problems."""

    def __init__(self, cfg: ZeroTrainConfig, model: torch.nn.Module | None, auto_values: dict[str, Any]):
        self.cfg = cfg
        self.model = model
        self.auto_values = auto_values
        self.problems: list[str] = []
        self.reported: set[str] = set()
        self.batch: dict[str, Any] = {}
        self.auto_batch_keys: set[str] = set()

    def report(self, path: str, message: str) -> None:
        self.problems.append(message)
        self.reported.add(path)

    def fill(self, world_size: int) -> dict[str, Any]:
        """A plain-dict copy of the config with every "auto" the rules can fill, filled."""
        data = self.cfg.model_dump(by_alias=True)
        # check_supported has passed, so every key kept here is switched off and
        # means nothing; dropping them also drops any "auto" inside them
        # (Hugging Face files say "amp": {"enabled": "auto"}).
        data["other_deepspeed_keys"] = {}
        for key in BATCH_KEYS:
            # The batch keys are settled by batch_sizes(); "auto" means "infer it".
            value = data.pop(key)
            if value == AUTO:
                self.auto_batch_keys.add(key)
                value = self.auto_values.get(key)
            self.batch[key] = value
        batch = self._batch_sizes(world_size)
        if batch is not None:
            data.update(zip(BATCH_KEYS, batch))
        if data["gradient_clipping"] == AUTO:
            data["gradient_clipping"] = self.auto_values.get("gradient_clipping", 0.0)
        self._precision(data)
        self._zero_buffers(data["zero_optimization"])
        lr = self._optimizer(data.get("optimizer"))
        self._scheduler(data.get("scheduler"), lr)
        return data

    def _batch_sizes(self, world_size: int) -> tuple[int, int, int] | None:
        """The three batch sizes, or None after reporting why they cannot be worked out."""
        train, micro, gas = (self.batch[key] for key in BATCH_KEYS)
        micro_key = "train_micro_batch_size_per_gpu"
        if train is None and micro is None and self.auto_batch_keys & {micro_key, "train_batch_size"}:
            self.report(micro_key, _cannot_infer(micro_key, "set it in the config"))
            return None
        try:
            return resolve_batch_sizes(train, micro, gas, world_size)
        except ConfigError as error:
            self.report(micro_key, str(error))
            return None

    # ---- rules ----

    def _precision(self, data: dict[str, Any]) -> None:
        fp16, bf16 = data["fp16"]["enabled"], data["bf16"]["enabled"]
        dtype = _floating_dtype(self.model)
        model_fp16 = model_bf16 = False
        if dtype is not None:
            import torch  # already loaded: the model is a torch module

            model_fp16, model_bf16 = dtype == torch.float16, dtype == torch.bfloat16
        if fp16 == AUTO:
            fp16 = self.auto_values.get("fp16.enabled", model_fp16 and bf16 is not True)
        if bf16 == AUTO:
            bf16 = self.auto_values.get("bf16.enabled", model_bf16 and fp16 is not True)
        data["fp16"]["enabled"], data["bf16"]["enabled"] = fp16, bf16

    def _zero_buffers(self, zero: dict[str, Any]) -> None:
        hidden: int | None = None
        for key, rule in HIDDEN_SIZE_RULES.items():
            if zero[key] != AUTO:
                continue
            path = f"zero_optimization.{key}"
            if path in self.auto_values:
                zero[key] = self.auto_values[path]
                continue
            hidden = hidden or _hidden_size(self.model)
            if hidden is None:
                self.report(
                    path,
                    f'{path} is "auto", which needs the model\'s hidden size (model.config.hidden_size), '
                    f"but {'no model was given' if self.model is None else 'the model has no config.hidden_size'}: "
                    f"set {path} to a number"
                )
            else:
                zero[key] = rule(hidden)

    def _optimizer(self, optimizer: dict[str, Any] | None) -> Any:
        """Fill optimizer params; returns the resolved lr, or None when unknown."""
        if optimizer is None:
            return None
        params = optimizer["params"]
        for key, value in params.items():
            if value != AUTO:
                continue
            path = f"optimizer.params.{key}"
            if path in self.auto_values:
                params[key] = self.auto_values[path]
            elif key in OPTIMIZER_PARAM_DEFAULTS:
                params[key] = OPTIMIZER_PARAM_DEFAULTS[key]
            else:
                self.report(path, _cannot_infer(path))
        lr = params.get("lr")
        return None if lr == AUTO else lr

    def _scheduler(self, scheduler: dict[str, Any] | None, lr: Any) -> None:
        if scheduler is None:
            return
        params = scheduler["params"]
        for key, value in params.items():
            if value != AUTO:
                continue
            path = f"scheduler.params.{key}"
            if path in self.auto_values:
                params[key] = self.auto_values[path]
            elif key == "warmup_min_lr":
                params[key] = 0.0
            elif key == "warmup_max_lr" and lr is not None:
                params[key] = lr
            elif key == "warmup_max_lr":
                self.report(
                    path,
                    f'{path} is "auto", which follows optimizer.params.lr, but that is not known: '
                    f"set optimizer.params.lr (or {path}) to a number"
                )
            else:
                self.report(path, _cannot_infer(path))


def _cannot_infer(path: str, fix: str = "set a number") -> str:
    return f'{path} is "auto" and zerotrain cannot infer it here: {fix}, or let `zerotrain train` fill it'


def _floating_dtype(model: torch.nn.Module | None) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter."""
    if model is None:
        return None
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None


def _hidden_size(model: Any) -> int | None:
    """``model.config.hidden_size``, or the largest of ``hidden_sizes`` (vision models)."""
    for candidate in (model, getattr(model, "module", None)):
        config = getattr(candidate, "config", None)
        if config is None:
            continue
        size = getattr(config, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
        sizes = getattr(config, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    return None


def _autos_left(value: Any, path: str = "") -> list[str]:
    """Dotted paths of every "auto" still in a plain-dict config."""
    if isinstance(value, Mapping):
        found: list[str] = []
        for key, item in value.items():
            found.extend(_autos_left(item, f"{path}.{key}" if path else str(key)))
        return found
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in _autos_left(item, f"{path}[{i}]")]
    return [path] if value == AUTO else []
