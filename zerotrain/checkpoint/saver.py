"""save_checkpoint: every rank writes only its own slices; the directory appears atomically.

Protocol (a process killed at any point leaves the previous checkpoint whole):
  1. all ranks meet (a call from one rank alone fails after a timeout, naming the absent ranks);
  2. each rank writes its shard and RNG files into a hidden temporary directory, fsynced;
  3. rank 0 writes meta.json and state.pt there, then renames the directory to TAG;
  4. rank 0 replaces `latest` (system/durable_files.py: write + fsync + os.replace) — the last change;
  5. all ranks meet again, so no rank runs ahead of a half-written checkpoint.

A write that fails on any rank (a full disk, a quota) fails the save on every rank
alike: the temporary directory is removed, `latest` still names the previous
checkpoint, and the error says where and how many bytes the checkpoint needs.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zerotrain.comm.fault_points import fault_point
from zerotrain.checkpoint.coordination import Coordinator
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.reader import read_latest
from zerotrain.checkpoint.file_mode import default_file_mode
from zerotrain.checkpoint.layout import (
    FORMAT, LATEST, MASTER, META, MODULE, STATE, param_slices_in, rng_file, save_range, shard_file, slice_key,
)
from zerotrain.checkpoint.zero_to_fp32_script import write_zero_to_fp32_script
from zerotrain.system.durable_files import atomic_write_text, fsync_path, rename_durably

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def save_checkpoint(engine, save_dir: str | os.PathLike, tag: str | None, client_state: dict | None, save_latest: bool) -> str:
    """Writes `engine`'s full training state under SAVE_DIR/TAG; returns the tag directory."""
    coord = Coordinator.for_engine(engine)
    coord.meet("save_checkpoint")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if "/" in tag or tag.startswith("."):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain name such as global_step100")
    root = Path(save_dir)
    tmp_name = coord.from_rank0(f".tmp-{tag}-{uuid.uuid4().hex[:8]}" if engine.rank == 0 else None)
    tmp = root / tmp_name
    if engine.rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    coord.meet("save_checkpoint:mkdir")

    index, nbytes, failure = {}, 0, None
    try:
        with engine.optimizer.states_resident():  # NVMe offload: bring the state in to write it
            index, nbytes = _write_rank_files(engine, tmp)
    except OSError as error:
        failure = _describe_os_error(error)
    fault_point("after_shards")
    reports = coord.gather_to_rank0((index, nbytes, failure))
    verdict = None
    if engine.rank == 0:
        verdict = _finish_on_rank0(engine, root, tmp, tag, reports, client_state, save_latest)
    verdict = coord.from_rank0(verdict)
    coord.meet("save_checkpoint:done")
    if verdict is not None:
        raise CheckpointError(verdict)
    return str(root / tag)


def _finish_on_rank0(engine, root: Path, tmp: Path, tag: str, reports: list, client_state, save_latest) -> str | None:
    """Writes the common files and publishes TAG; returns the error message if the save failed."""
    failures = [f"rank {r}: {failure}" for r, (_, _, failure) in enumerate(reports) if failure]
    rank_bytes = sum(nbytes for _, nbytes, _ in reports)
    if not failures:
        try:
            with engine.optimizer.states_resident():
                _write_common_files(engine, tmp, tag, [index for index, _, _ in reports], client_state)
            fault_point("before_rename")
            _move_into_place(tmp, root / tag)
            if save_latest:
                fault_point("before_latest")
                publish_latest(root, tag)
            write_zero_to_fp32_script(root)  # as DeepSpeed: the folder carries its own converter
            return None
        except OSError as error:
            failures.append(f"rank 0: {_describe_os_error(error)}")
    shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
    return _save_failure_message(root, tag, failures, rank_bytes)


def _describe_os_error(error: OSError) -> str:
    name = errno.errorcode.get(error.errno or 0, "")
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or error}{where}" + (f" [{name}]" if name else "")


def _save_failure_message(root: Path, tag: str, failures: list[str], needed: int) -> str:
    from rich.filesize import decimal

    try:
        free = f"{decimal(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = "free space unknown"
    try:
        previous = read_latest(root / LATEST) if (root / LATEST).is_file() else None
    except CheckpointError:
        previous = None  # unreadable: say nothing of it
    kept = f"the previous checkpoint {previous!r} is intact and resumable" if previous else "no earlier checkpoint exists"
    return (
        f"could not save checkpoint {tag!r} in {root}: " + "; ".join(failures) + ". "
        f"It needs about {decimal(needed)} ({needed:,} bytes; {free}); nothing of it was left behind and {kept}. "
        "Free some space (or save to a larger disk) and save again."
    )


def _write_rank_files(engine, tmp: Path) -> tuple[dict[str, list], int]:
    """This rank's slices of every bucket (fp32 master + per-element optimizer state) and RNG.

    Returns the file index and the bytes of tensors this rank writes (for a disk-full message).
    """
    tensors: dict[str, torch.Tensor] = {}
    entries: list = []
    inner = engine.optimizer.optimizer
    for fp in engine.flat_params:
        lo, hi = save_range(fp.padded_numel, engine.rank, engine.world_size)
        master_start = fp.shard_start  # the master covers [shard_start, shard_start + len(master))
        state = inner.state.get(fp.master, {})
        for name, start, numel, flat in param_slices_in(fp.names, fp.offsets, fp.numels, lo, hi):
            i = flat - master_start
            entries.append([name, start, numel])
            tensors[slice_key(MASTER, name, start)] = fp.master[i : i + numel].detach().float().cpu().clone()
            for key, value in state.items():
                if torch.is_tensor(value) and value.numel() == fp.master.numel():
                    tensors[slice_key(key, name, start)] = value[i : i + numel].detach().float().cpu().clone()
    if engine.rank == 0:
        for name, t in module_entries(engine).items():
            tensors[slice_key(MODULE, name, 0)] = t.detach().cpu().contiguous().clone()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    path = tmp / shard_file(engine.rank)
    save_file(tensors, str(path), metadata={"format": FORMAT})
    os.chmod(path, default_file_mode())  # safetensors creates 0600; a checkpoint is an ordinary file
    fsync_path(path)
    fault_point("shard_write")
    rng_path = tmp / rng_file(engine.rank)
    torch.save(_rng_state(), rng_path)
    fsync_path(rng_path)
    return {shard_file(engine.rank): entries}, nbytes


def module_entries(engine) -> dict[str, torch.Tensor]:
    """What the optimizer does not own: frozen parameters and persistent buffers."""
    trainable = {id(p) for fp in engine.flat_params for p in fp.params}
    return {name: t for name, t in engine.module.state_dict(keep_vars=True).items() if id(t) not in trainable}


def _write_common_files(engine, tmp: Path, tag: str, indexes: list[dict], client_state: dict | None) -> None:
    inner = engine.optimizer.optimizer
    kinds = [MASTER]
    group_scalars: list[dict] = [{} for _ in inner.param_groups]
    for g, group in enumerate(inner.param_groups):
        for p in group["params"]:
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.numel() == p.numel() and p.numel() > 1:
                    if key not in kinds:
                        kinds.append(key)
                elif torch.is_tensor(value) and value.numel() == 1:
                    group_scalars[g][key] = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
                elif not torch.is_tensor(value):
                    group_scalars[g][key] = {"value": value, "dtype": None}
    others = module_entries(engine)
    param_names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}  # frozen ones, vs buffers
    meta = {
        "format": FORMAT,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.zero_optimization_stage(),
        "compute_dtype": _DTYPE_NAMES[engine.compute_dtype],
        "optimizer_class": type(inner).__name__,
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
        },
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "params": {
            name: {"shape": list(shape), "group": fp.group_index}
            for fp in engine.flat_params
            for name, shape in zip(fp.names, fp.shapes)
        },
        "module": {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "is_parameter": name in param_names}
            for name, t in others.items()
        },
        "kinds": kinds,
        "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}) for g in inner.param_groups],
        "group_scalars": group_scalars,
        "files": {file: entries for index in indexes for file, entries in index.items()},
        "hf_config": _hf_config(engine.module),
    }
    _check_weights_only_loadable(client_state)
    state_path = tmp / STATE
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    torch.save({"lr_scheduler": scheduler, "client_state": client_state or {}}, state_path)
    fsync_path(state_path)
    meta_path = tmp / META
    meta_path.write_text(json.dumps(meta, indent=1))
    fsync_path(meta_path)


def _move_into_place(tmp: Path, final: Path) -> None:
    parked = None
    if final.exists():
        # Directories cannot be swapped atomically: park the old one; readers fall back to it.
        parked = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, parked)
    rename_durably(tmp, final)
    if parked is not None:
        shutil.rmtree(parked, ignore_errors=True)


def publish_latest(root: str | os.PathLike, tag: str) -> None:
    """Points ROOT/latest at `tag`: a save's last act (also a resume's from a tag newer than `latest`)."""
    atomic_write_text(Path(root) / LATEST, tag)


def _rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(state), gauss]}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _hf_config(module) -> dict | None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return _jsonable(config.to_dict())


def _jsonable(obj):
    """JSON-safe copy: tuples to lists, tensors to numbers, other objects to their repr."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


_SAFE_TYPES = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device)


def _check_weights_only_loadable(obj, path: str = "client_state") -> None:
    """client_state must load back with torch.load(weights_only=True): plain data and tensors only."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_weights_only_loadable(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_weights_only_loadable(v, f"{path}[{i}]")
    elif not isinstance(obj, _SAFE_TYPES):
        raise CheckpointError(
            f"{path} is a {type(obj).__name__}: client_state may hold only dicts, lists, tuples, numbers, "
            "strings and tensors, so that it loads without unpickling code"
        )
