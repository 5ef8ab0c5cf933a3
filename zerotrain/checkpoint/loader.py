"""load_checkpoint: fills this engine's shards from a checkpoint saved at any world size and stage.

Each rank reads only the parameter ranges its own master shard covers (plus the
whole parameters at stages 0-2, which every rank holds anyway, by all-gathering
after the load). Nothing is unpickled beyond torch.load(weights_only=True), and what the
files hold is checked before it reaches the engine: a checkpoint from elsewhere fails
with a CheckpointError naming the file, never with an error from deep inside torch.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from zerotrain.checkpoint.coordination import Coordinator
from zerotrain.checkpoint.deepspeed_layout import find_deepspeed_tag_dir
from zerotrain.checkpoint.deepspeed_resume import DeepSpeedResumeReader
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.layout import LATEST, MASTER, META, STATE, param_slices_in, rng_file
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.checkpoint.saver import module_entries
from zerotrain.optim.fused_kernels import scalar_state

log = logging.getLogger("zerotrain")


def load_checkpoint(
    engine,
    load_dir: str | os.PathLike,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    strip_prefix: str | None = None,
) -> tuple[str | None, dict | None]:
    """Restores `engine` from LOAD_DIR/TAG (default: the tag in `latest`). Returns (path, client_state).
    `strip_prefix`: cut from a DeepSpeed checkpoint's names (it saved a wrapped model)."""
    coord = Coordinator.for_engine(engine)
    coord.meet("load_checkpoint")
    deepspeed_tag = find_deepspeed_tag_dir(load_dir, tag, engine.parsed_config.checkpoint.load_universal)
    if deepspeed_tag is None and tag is None and not (Path(load_dir) / LATEST).is_file():
        # As DeepSpeed: starting a run with nothing to resume from is not an error.
        if engine.rank == 0:
            log.warning("no checkpoint to load: %s does not exist", Path(load_dir) / LATEST)
        return None, None
    if deepspeed_tag is not None:  # written by DeepSpeed: read through the same interface, restored alike
        opened = DeepSpeedResumeReader(deepspeed_tag, engine, load_optimizer_states, load_lr_scheduler_states,
                                       strip_prefix)
    elif strip_prefix:
        raise CheckpointError(f"{load_dir}: strip_prefix applies to DeepSpeed's checkpoints; zerotrain saves "
                              "the unwrapped model's names: leave it out")
    else:
        opened = CheckpointReader(load_dir, tag)
    with opened as reader, engine.optimizer.states_resident():
        _check_names(engine, reader, load_module_strict)
        _load_weights(engine, reader)
        client_state: dict = {}
        if not load_module_only:
            state = reader.state if deepspeed_tag else _load_torch_file(reader, reader.tag_dir / STATE)
            if load_optimizer_states:
                _load_optimizer_state(engine, reader)
            _load_counters(engine, reader)
            if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler"):
                with _blamed_on(reader, reader.tag_dir / STATE, "lr_scheduler"):
                    engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            same_world = reader.meta["world_size"] == engine.world_size
            _load_rng(reader, reader.tag_dir / rng_file(engine.rank), same_world=same_world)
            client_state = state.get("client_state", {})
        path = str(reader.tag_dir)
    coord.meet("load_checkpoint:done")
    return path, client_state


def _check_names(engine, reader: CheckpointReader, strict: bool) -> None:
    ours = {n for fp in engine.flat_params for n in fp.names} | set(module_entries(engine))
    theirs = set(reader.params) | set(reader.module_entries)
    missing, unexpected = sorted(ours - theirs), sorted(theirs - ours)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{reader.tag_dir} does not match this model: missing {missing[:10]}, unexpected {unexpected[:10]} "
            "(pass load_module_strict=False to load the parameters that match)"
        )
    for fp in engine.flat_params:  # a parameter of another size would load only partly, or not at all
        for name, numel in zip(fp.names, fp.numels):
            stored = _stored_numel(reader, name)
            if stored is not None and stored != numel:
                raise CheckpointError(
                    f"{reader.tag_dir / META}: {name!r} has {stored} elements there, but {numel} in this model: "
                    "the checkpoint is of another model"
                )


def _load_weights(engine, reader: CheckpointReader) -> None:
    with torch.no_grad():
        for fp in engine.flat_params:
            lo = fp.shard_start
            for name, start, numel, flat in param_slices_in(fp.names, fp.offsets, fp.numels, lo, lo + fp.master.numel()):
                values = _read_values(reader, name, start, numel)
                if values is not None:
                    fp.master[flat - lo : flat - lo + numel].copy_(values)
            fp.copy_master_to_shard()  # also when the shard is parked on NVMe
        engine.optimizer.all_gather_params()
        for name, t in module_entries(engine).items():
            stored = _stored_numel(reader, name)
            if stored is not None and stored != t.numel():
                raise CheckpointError(
                    f"{reader.tag_dir / META}: {name!r} has {stored} elements there, but {t.numel()} "
                    f"({list(t.shape)}) in this model: the checkpoint is of another model"
                )
            values = _read_values(reader, name, 0, t.numel())
            if values is not None:
                t.data.copy_(values.view(t.shape))


def _stored_numel(reader: CheckpointReader, name: str) -> int | None:
    """How many elements the checkpoint has of `name` (None: it has none), from meta.json's checked shapes."""
    if name in reader.params:
        return reader.numel(name)
    if name in reader.module_entries:
        return math.prod(reader.module_entries[name]["shape"])
    return None


def _read_values(reader: CheckpointReader, name: str, start: int, numel: int) -> torch.Tensor | None:
    """Elements of `name` wherever the checkpoint has them: trainable there, or stored whole."""
    if name in reader.params:
        return reader.read_range(MASTER, name, start, start + numel)
    if name in reader.module_entries:
        return reader.read_module(name).reshape(-1)[start : start + numel]
    return None


# How this engine's optimizer runs on its own device, not training state: a CPU run's fused CPU Adam
# must not make a GPU run take CUDA's fused kernel with its `step` counters left on the CPU.
KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _load_optimizer_state(engine, reader: CheckpointReader) -> None:
    inner = engine.optimizer.optimizer
    meta = reader.meta
    _check_optimizer_meta(reader)
    if len(meta["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(
            f"{reader.tag_dir}: the checkpoint has {len(meta['param_groups'])} optimizer param groups, this engine "
            f"{len(inner.param_groups)}; pass the same model_parameters grouping, or load_optimizer_states=False"
        )
    kinds = [k for k in reader.kinds if k != MASTER]
    for fp in engine.flat_params:
        state = inner.state[fp.master]
        lo = fp.shard_start
        slices = param_slices_in(fp.names, fp.offsets, fp.numels, lo, lo + fp.master.numel())
        for kind in kinds:
            buf = torch.zeros_like(fp.master, dtype=torch.float32)
            for name, start, numel, flat in slices:
                if name in reader.params:
                    buf[flat - lo : flat - lo + numel].copy_(reader.read_range(kind, name, start, start + numel))
            state[kind] = buf
        group = next(g for g in inner.param_groups if any(p is fp.master for p in g["params"]))
        for key, spec in meta["group_scalars"][fp.group_index].items():
            dtype = spec["dtype"]
            # Placed by this optimizer's rule (a fused kernel's `step` on the master's device), not the saver's.
            state[key] = scalar_state(spec["value"], getattr(torch, dtype), key, fp.master, group) if dtype else spec["value"]
    for group, saved in zip(inner.param_groups, meta["param_groups"]):
        for key, value in saved.items():
            if key in group and key not in KERNEL_CHOICES:
                if not _same_kind(group[key], value):
                    raise CheckpointError(
                        f"{reader.tag_dir / META}: param_groups gives {key} as {value!r:.60}, where this optimizer "
                        f"has {group[key]!r:.60}; the file is corrupt, or pass load_optimizer_states=False"
                    )
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _check_optimizer_meta(reader: CheckpointReader) -> None:
    """param_groups and group_scalars of meta.json hold what `_load_optimizer_state` reads, or CheckpointError."""
    meta, where = reader.meta, reader.tag_dir / META
    groups, scalars = meta.get("param_groups"), meta.get("group_scalars")
    if not isinstance(groups, list) or not isinstance(scalars, list) or len(groups) != len(scalars):
        raise CheckpointError(
            f"{where} has no usable optimizer description (param_groups and group_scalars, one per group): "
            "it is corrupt or was not written by engine.save_checkpoint; pass load_optimizer_states=False"
        )
    for group, specs in zip(groups, scalars):
        if not isinstance(group, dict) or not isinstance(specs, dict):
            raise CheckpointError(f"{where}: an entry of param_groups or group_scalars is not an object")
        for key, spec in specs.items():
            dtype = spec.get("dtype") if isinstance(spec, dict) else "?"
            value = spec.get("value") if isinstance(spec, dict) else None
            if dtype is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype) and number):
                raise CheckpointError(
                    f"{where}: group_scalars gives optimizer state {key!r:.60} as {spec!r:.80}, not "
                    '{"value": NUMBER, "dtype": TORCH_DTYPE}; the file is corrupt'
                )


def _same_kind(current: object, saved: object) -> bool:
    """Whether a param_groups value from meta.json can stand where the optimizer has `current`."""
    if isinstance(current, bool):
        return isinstance(saved, bool) or saved is None
    if current is None:
        return not isinstance(saved, (list, dict))
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(current, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(current) and all(_same_kind(c, s) for c, s in
                                                                               zip(current, saved))
    return isinstance(saved, type(current)) or not isinstance(saved, (list, dict))


def _load_counters(engine, reader: CheckpointReader) -> None:
    meta = reader.meta
    counters = meta["counters"]  # whole numbers: read_meta checked them
    engine.global_steps = counters["global_steps"]
    engine.micro_steps = counters["micro_steps"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.global_samples = counters["global_samples"]
    if engine.loss_scaler is not None and meta.get("loss_scaler"):
        with _blamed_on(reader, reader.tag_dir / META, "loss_scaler"):
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])


def _load_rng(reader: CheckpointReader, path: Path, same_world: bool) -> None:
    """Restores this rank's RNG streams (only meaningful when the world size is unchanged)."""
    if not same_world or not path.is_file():
        return
    rng = _load_torch_file(reader, path)
    with _blamed_on(reader, path, "RNG states"):
        torch.set_rng_state(rng["torch"])
        version, state, gauss = rng["python"]
        random.setstate((version, tuple(state), gauss))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


@contextmanager
def _blamed_on(reader: CheckpointReader, path: Path, what: str) -> Iterator[None]:
    """Turns an error from restoring `what` out of `path` into a CheckpointError naming the file.

    Those values reach torch, Python's random or a scheduler as they were saved: a file
    of the wrong structure fails there with a KeyError or TypeError that names nothing.
    """
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        problem = f"{type(error).__name__}: {error}"
        raise reader.corrupt(f"cannot restore the {what} from {path}: {problem:.200}") from error


def _load_torch_file(reader: CheckpointReader, path: Path) -> dict:
    if not path.is_file():
        raise reader.corrupt(f"missing checkpoint file {path}")
    try:
        # weights_only: tensors and plain data only, so a crafted file cannot run code here.
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise reader.corrupt(f"cannot read {path}: truncated, corrupt or not weights-only data ({e})") from e
    if not isinstance(loaded, dict):
        raise reader.corrupt(f"cannot read {path}: it holds a {type(loaded).__name__}, not the dict a checkpoint saves")
    return loaded
