"""Features a config can ask for that this version of zerotrain does not build.

A key that parses but whose feature is missing must never be ignored silently:
``check_supported`` refuses the config and says what to change.  The features
are one data table, ``NOT_YET_BUILT``; a later version that builds a feature
deletes its row.

DeepSpeed's monitor sections (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``,
``trackio``) are a table of their own, ``MONITORS``: zerotrain's engine writes no
metrics files by design, so switching one on is refused with what to use instead
(the ``logging`` section of a `zerotrain train` YAML, or logging from the training
loop).  Switched off, they are accepted silently, as every copied DeepSpeed file has them.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass
from typing import Any, Callable

from zerotrain.config.errors import ConfigError, format_problems, render_value
from zerotrain.config.feature_schema import ActivationCheckpointingConfig, CheckpointConfig
from zerotrain.config.schema import ZeroTrainConfig

LATER = "a later version"


@dataclass(frozen=True)
class NotYetBuilt:
    """One feature zerotrain does not build yet, and how to recognise a request for it."""

    feature: str
    """What the user asked for, in words."""
    setting: str
    """The dotted key that asks for it."""
    requested: Callable[[ZeroTrainConfig], Any]
    """Returns the offending value when the config asks for the feature, else None."""
    fix: str
    """What to change in the config."""
    arrives_with: str = LATER
    """Which work brings the feature."""


def _when(flag: Callable[[ZeroTrainConfig], Any]) -> Callable[[ZeroTrainConfig], Any]:
    """For boolean switches: the value when it is on."""

    def requested(cfg: ZeroTrainConfig) -> Any:
        value = flag(cfg)
        return value if value else None

    return requested


def _non_default(section: str, default: Any, honoured: tuple[str, ...] = ()) -> Callable[[ZeroTrainConfig], Any]:
    """For whole sections: the keys that differ from the defaults, less those zerotrain honours."""

    def requested(cfg: ZeroTrainConfig) -> Any:
        given = getattr(cfg, section).model_dump()
        reference = default.model_dump()
        changed = {k: v for k, v in given.items() if reference[k] != v and k not in honoured}
        return changed or None

    return requested


NOT_YET_BUILT: tuple[NotYetBuilt, ...] = (
    NotYetBuilt(
        "DeepCompile (ZeRO's collectives compiled into the graph)",
        "compile.deepcompile",
        _when(lambda cfg: cfg.compile.deepcompile),
        "set compile.deepcompile to false; compile.enabled: true (or engine.compile()) compiles each layer and "
        "the loss with ZeRO's hooks outside the graph",
    ),
    NotYetBuilt(
        "ZeRO++ quantized weights",
        "zero_optimization.zero_quantized_weights",
        _when(lambda cfg: cfg.zero_optimization.zero_quantized_weights),
        "set zero_optimization.zero_quantized_weights to false",
    ),
    NotYetBuilt(
        "ZeRO++ quantized frozen weights",
        "zero_optimization.zero_quantized_nontrainable_weights",
        _when(lambda cfg: cfg.zero_optimization.zero_quantized_nontrainable_weights),
        "set zero_optimization.zero_quantized_nontrainable_weights to false",
    ),
    NotYetBuilt(
        "ZeRO++ quantized gradients",
        "zero_optimization.zero_quantized_gradients",
        _when(lambda cfg: cfg.zero_optimization.zero_quantized_gradients),
        "set zero_optimization.zero_quantized_gradients to false",
    ),
    NotYetBuilt(
        "ZeRO++ hierarchical partitioning",
        "zero_optimization.zero_hpz_partition_size",
        lambda cfg: cfg.zero_optimization.zero_hpz_partition_size
        if cfg.zero_optimization.zero_hpz_partition_size > 1
        else None,
        "set zero_optimization.zero_hpz_partition_size to 1",
    ),
    NotYetBuilt(
        "LoCo-ZeRO++",
        "zero_optimization.zeropp_loco_param",
        lambda cfg: cfg.zero_optimization.zeropp_loco_param,
        "remove zero_optimization.zeropp_loco_param",
    ),
    NotYetBuilt(
        "MiCS sharding",
        "zero_optimization.mics_shard_size",
        lambda cfg: cfg.zero_optimization.mics_shard_size if cfg.zero_optimization.mics_shard_size > 0 else None,
        "set zero_optimization.mics_shard_size to -1",
    ),
    NotYetBuilt(
        "ZenFlow",
        "zero_optimization.zenflow",
        lambda cfg: cfg.zero_optimization.zenflow,
        "remove zero_optimization.zenflow",
    ),
    NotYetBuilt(
        "fp16 master weights",
        "fp16.fp16_master_weights_and_grads",
        _when(lambda cfg: cfg.fp16.fp16_master_weights_and_grads),
        "set fp16.fp16_master_weights_and_grads to false",
    ),
    NotYetBuilt(
        "bf16 master weights",
        "bf16.bf16_master_weights_and_grads",
        _when(lambda cfg: cfg.bf16.bf16_master_weights_and_grads),
        "set bf16.bf16_master_weights_and_grads to false",
    ),
    NotYetBuilt(
        "bf16 optimizer state",
        "bf16.bf16_optimizer_states",
        _when(lambda cfg: cfg.bf16.bf16_optimizer_states),
        "set bf16.bf16_optimizer_states to false",
    ),
    NotYetBuilt(
        "DeepSpeed activation checkpointing",
        "activation_checkpointing",
        _non_default("activation_checkpointing", ActivationCheckpointingConfig(), honoured=("cpu_checkpointing",)),
        "remove the activation_checkpointing section or leave it empty; for a Hugging Face model "
        "call model.gradient_checkpointing_enable() instead",
    ),
    NotYetBuilt(
        "checkpoint I/O options",
        "checkpoint",
        _non_default("checkpoint", CheckpointConfig(), honoured=("load_universal",)),
        "remove the checkpoint section or leave it empty",
    ),
)


@dataclass(frozen=True)
class Monitor:
    """A DeepSpeed monitor section and what replaces it in zerotrain."""

    section: str
    """The DeepSpeed key, e.g. "tensorboard"."""
    name: str
    """What it writes to, in words."""
    in_train: str | None
    """The `zerotrain train` YAML setting that does the same, or None when it has none."""
    in_loop: str
    """What a training loop of one's own calls instead."""


MONITORS: tuple[Monitor, ...] = (
    Monitor(
        "tensorboard", "TensorBoard",
        "logging.tensorboard.enabled: true (logging.tensorboard.dir picks the folder)",
        "torch.utils.tensorboard.SummaryWriter",
    ),
    Monitor(
        "wandb", "Weights & Biases",
        "logging.wandb.enabled: true (with logging.wandb.project, name and mode)",
        "wandb.init and wandb.log",
    ),
    Monitor(
        "csv_monitor", "CSV",
        "logging.csv: true (on by default: <output.dir>/metrics.csv)",
        "the csv module",
    ),
    Monitor("comet", "Comet", None, "comet_ml's Experiment.log_metrics"),
    Monitor("trackio", "Trackio", None, "trackio.init and trackio.log"),
)

TRAIN_LOGGERS = "CSV, TensorBoard and Weights & Biases"
"""What the `logging` section of a `zerotrain train` YAML writes to."""


def monitor_problem(monitor: Monitor, prefix: str = "") -> str:
    """Why a switched-on monitor section is refused and what to use instead.

    ``prefix`` "zero." means the section sits in a `zerotrain train` YAML's ``zero``
    section, so only the YAML's own ``logging`` section is offered.
    """
    key = f"{prefix}{monitor.section}"
    head = f"{key}.enabled = true: zerotrain does not run DeepSpeed's monitors, so this section would log nothing"
    in_yaml = f"zero.{monitor.section}"
    if monitor.in_train is not None:
        train = f"set {monitor.in_train} in the YAML's logging section and delete {in_yaml}"
    else:
        train = (
            f"there is no {monitor.name} logger (the YAML's logging section writes to {TRAIN_LOGGERS}): "
            f"use one of those and delete {in_yaml}"
        )
    if prefix:
        return f"{head}; {train}"
    loop = f"with zerotrain.initialize, log from your training loop ({monitor.in_loop}) and set {key}.enabled to false"
    return f"{head}. In `zerotrain train`: {train}. {loop[0].upper()}{loop[1:]}"


EMULATED_KEYS = {
    "hybrid_engine": "hybrid_engine: DeepSpeed's inference kernels for generation are not built in zerotrain; "
                     "generate() runs on the training model (at ZeRO-3 on parameters gathered layer by layer), "
                     "as DeepSpeed does for models its kernels do not cover",
}
"""DeepSpeed sections whose feature is replaced by what the plain engine does, said once when on
(DeepSpeed-Chat's step 3 writes `hybrid_engine` with --enable_hybrid_engine)."""

NO_OP_SWITCHES: dict[str, tuple[Callable[[ZeroTrainConfig], Any], str]] = {
    "zero_optimization.elastic_checkpoint": (
        lambda cfg: cfg.zero_optimization.elastic_checkpoint,
        "zero_optimization.elastic_checkpoint: true changes nothing in zerotrain: its checkpoints always load at "
        "any world size and stage",
    ),
}
"""Switches zerotrain models whose purpose its own design already serves: accepted, said once when on."""

NEVER_REFUSED_KEYS = frozenset({"aio", *EMULATED_KEYS})
"""Unmodeled DeepSpeed sections accepted whatever they hold: the emulated ones above, and `aio`,
which sizes the async I/O of DeepSpeed's NVMe offload and switches nothing on (zerotrain's NVMe
store has its own threads). Lightning writes `aio` into every config it builds, with defaults."""


def check_supported(cfg: ZeroTrainConfig, *, prefix: str = "") -> None:
    """Raise ConfigError listing every feature ``cfg`` asks for that is not built yet.

    Values still "auto" are fine here: no row of the table depends on them.
    ``prefix`` is put before every key named (``"zero."`` for the ``zero`` section of a
    `zerotrain train` YAML, whose monitors are then pointed at that YAML's ``logging``).
    """
    problems: list[str] = []
    for key, message in EMULATED_KEYS.items():
        if _switched_on(cfg.other_deepspeed_keys.get(key)):
            _say_once(message)
    for switched_on, message in NO_OP_SWITCHES.values():
        if switched_on(cfg):
            _say_once(f"{prefix}{message}")
    for row in NOT_YET_BUILT:
        value = row.requested(cfg)
        if value is None:
            continue
        problems.append(
            f"{prefix}{row.setting} = {render_value(value)}: {row.feature} is not built yet in zerotrain "
            f"(arrives with {row.arrives_with}); {row.fix}"
        )
    for monitor in MONITORS:
        if getattr(cfg, monitor.section).enabled:
            problems.append(monitor_problem(monitor, prefix))
    for key, value in cfg.other_deepspeed_keys.items():
        if key not in NEVER_REFUSED_KEYS and _switched_on(value):
            problems.append(
                f"{prefix}{key} = {render_value(value)}: this DeepSpeed feature is not built in zerotrain; "
                f"remove '{prefix}{key}' from the config"
            )
    if problems:
        raise ConfigError(format_problems("this config asks for features zerotrain does not build yet:", problems))


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger("zerotrain").warning(message)


def _switched_on(value: Any) -> bool:
    """Whether a DeepSpeed key we do not model asks for its feature.

    "auto" counts as off: Hugging Face files write "amp": {"enabled": "auto"},
    which its trainer only turns on for a backend zerotrain does not have.
    """
    if isinstance(value, dict) and "enabled" in value:
        value = value["enabled"]
    return bool(value) and value != "auto"
