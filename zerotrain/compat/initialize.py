"""`zerotrain.initialize`: DeepSpeed's entry point, same signature and return value."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Iterable

import torch
from torch import nn

from zerotrain.config import ConfigError, load_config, resolve_config
from zerotrain.config.auto import BatchSizeMismatch
from zerotrain.comm.distributed import device_for, init_distributed


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Iterable | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config: Any = None,
    config_params: Any = None,
    mpu: Any = None,
):
    """Wraps `model` for ZeRO training, as `deepspeed.initialize` does.

    Args:
        args: an argparse namespace; its `deepspeed_config` is used when `config` is None.
        model: the torch module to train.
        optimizer: a torch optimizer; rebuilt over the rank's shards with the same class and
            hyper-parameters. Mutually exclusive with an `optimizer` section in the config.
        model_parameters: parameters or torch-style param groups to train (default: all of `model`'s).
        training_data: a Dataset; returned as a DataLoader with a DistributedSampler.
        lr_scheduler: a scheduler built on `optimizer`, or a callable taking the optimizer.
        dist_init_required: False to require an already-initialized process group.
        collate_fn: passed to the DataLoader.
        config: a dict, a path (.json with comments, .yaml) or a base64 JSON string.
        config_params: DeepSpeed's older name for `config`.
        mpu: a sequence-parallel layout (what `UlyssesSPAttentionHF.register_with_transformers`
            returns; Accelerate passes it): its `get_sequence_parallel_world_size()` sets
            `sequence_parallel_size`. Model-parallel (Megatron) mpus are refused.

    Returns:
        (engine, optimizer, training_dataloader, lr_scheduler)
    """
    from zerotrain.runtime.engine import Engine  # the engine imports torch-heavy modules; keep `import zerotrain` light

    if model is None:
        raise ValueError("zerotrain.initialize needs a model (model=...)")
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError(
            "no config: pass config=... (a dict or a path) or args with a deepspeed_config attribute"
        )
    if dist_init_required is False and not torch.distributed.is_initialized():
        raise RuntimeError("dist_init_required=False, but torch.distributed is not initialized")
    launch = init_distributed()
    _set_up_logging(launch.rank)

    cfg = load_config(config)
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(
            "an optimizer was passed to initialize() and the config has an \"optimizer\" section: "
            "use one of the two (remove the section, or drop the optimizer argument)"
        )
    if mpu is not None:
        cfg = with_sequence_parallel_of(cfg, mpu)
    try:
        cfg = resolve_config(cfg, world_size=torch.distributed.get_world_size(), model=model)
    except BatchSizeMismatch as error:
        if cfg.sequence_parallel_size > 1 and mpu is not None:
            raise ConfigError(f"{error}. {ACCELERATE_SP_BATCH_HINT}") from None
        raise

    param_groups = param_groups_of(model, optimizer, model_parameters)
    engine = Engine(
        model,
        cfg,
        device_for(launch.local_rank),
        param_groups,
        client_optimizer=optimizer,
        client_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    if cfg.compile.enabled:  # DeepSpeed 0.14's `compile` section: compiled as engine.compile() would
        engine.compile(cfg.compile.backend, dict(cfg.compile.kwargs))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


ACCELERATE_SP_BATCH_HINT = (
    "With sequence parallelism the world size here is world / sequence_parallel_size (the ranks of a sequence "
    "group train the same samples). Accelerate writes train_batch_size = micro x accumulation x "
    "ParallelismConfig.data_parallel_size: set ParallelismConfig(dp_shard_size=world / sp_size) (or "
    "dp_replicate_size) so that it counts the sequence groups, or set train_batch_size yourself"
)


def with_sequence_parallel_of(cfg: Any, mpu: Any) -> Any:
    """`cfg` with `sequence_parallel_size` from `mpu` (DeepSpeed takes it from the mpu, not the
    config). A config that names another size, or an mpu without sequence-parallel accessors, is refused."""
    if not hasattr(mpu, "get_sequence_parallel_world_size"):
        from zerotrain.compat.unsupported_features import model_parallel_unsupported

        model_parallel_unsupported()
    size = int(mpu.get_sequence_parallel_world_size())
    if "sequence_parallel_size" in cfg.model_fields_set and cfg.sequence_parallel_size != size:
        raise ConfigError(
            f"the config sets sequence_parallel_size {cfg.sequence_parallel_size}, and the mpu passed to initialize() "
            f"has a sequence-parallel world size of {size}: remove the key (the mpu decides) or make them equal"
        )
    if groups_module := _standin_groups():
        groups_module.mpu = mpu  # DeepSpeed's engine sets it: Accelerate and the Trainer read groups._get_sequence_*
    return cfg.model_copy(update={"sequence_parallel_size": size})


def _standin_groups():
    standin = sys.modules.get("deepspeed")
    if standin is None or not getattr(standin, "__zerotrain_standin__", False):
        return None
    from deepspeed.utils import groups

    return groups


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line flags (`--deepspeed`, `--deepspeed_config`) to `parser`."""
    group = parser.add_argument_group("zerotrain", "DeepSpeed-compatible configuration")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable zerotrain (kept for compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    return parser


def _set_up_logging(rank: int) -> None:
    """Rank 0 reports progress (steps_per_print) on the terminal; other ranks only warnings."""
    logger = logging.getLogger("zerotrain")
    if not logger.handlers:
        from rich.console import Console
        from rich.logging import RichHandler

        console = Console()
        if console.is_terminal:
            logger.addHandler(RichHandler(console=console, show_path=False, show_time=False))
        else:  # a log file or a pipe: one line per record, never folded or padded to 80 columns
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
            logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def param_groups_of(model: nn.Module, optimizer=None, model_parameters=None) -> list[dict]:
    """Torch-style param groups: from the client optimizer, `model_parameters`, or the whole model
    (how `initialize` reads them; the memory estimate reads them the same way)."""
    if optimizer is not None:
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(model.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
