"""Leaving zerotrain: a checkpoint's full model as safetensors files or an in-memory state dict.

A checkpoint stores each parameter's fp32 master in slices spread over the ranks'
shard files. Consolidation plans the output files from the shapes in meta.json,
then reads one tensor at a time and writes each output file as soon as its
tensors are collected, so memory stays near one output shard, never the model.
The Hugging Face directory export builds on this in hf_export.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.file_mode import default_file_mode
from zerotrain.checkpoint.layout import MASTER, META
from zerotrain.checkpoint.reader import CheckpointReader

WEIGHTS_NAME = "model.safetensors"
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
_SIZE_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}

# The reader maps shard files, and pages read through a map count as this process's memory
# until it is unmapped: closing the reader every so many bytes keeps them out of the peak.
UNMAP_EVERY_BYTES = 64 * 2**20

# progress(tensors_done, tensors_total, bytes_done, bytes_total), called after each tensor is read.
ProgressCallback = Callable[[int, int, int, int], None]


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" / "10KB" (powers of 10) / "2GiB" (powers of 2).

    As in Hugging Face, a lowercase "b" after the unit ("5Gb") means bits.
    """
    if isinstance(size, int):
        return size
    text = str(size).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", text)
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in _SIZE_UNITS):
        raise ValueError(f"cannot read size {size!r}: use bytes or a number with GB, MB, KB, GiB, MiB or KiB")
    value = float(match.group(1)) * _SIZE_UNITS.get(unit, 1)
    bits = len(match.group(2)) > 1 and match.group(2).endswith("b")
    return int(value / 8 if bits else value)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch dtype for "fp32" / "bf16" / "fp16" (or the torch names float32, bfloat16, float16)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ValueError(f"unsupported output dtype {dtype!r}: use fp32, bf16 or fp16")
    return DTYPES[key]


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # as written
    source: str  # as stored in the checkpoint
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written
    trainable: bool  # a sliced fp32 master; else stored whole under "module/"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _stored_dtype(reader: CheckpointReader, name: str, text: str) -> torch.dtype:
    key = str(text).removeprefix("torch.")
    dtype = DTYPES.get(key.lower(), getattr(torch, key, None))
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{reader.tag_dir / META}: unknown dtype {text!r} of {name!r}")
    return dtype


def plan_tensors(reader: CheckpointReader, dtype: torch.dtype, rename: dict[str, str]) -> list[PlannedTensor]:
    planned = [
        PlannedTensor(rename.get(name, name), name, tuple(info["shape"]), dtype, True)
        for name, info in reader.params.items()
    ]
    for name, info in reader.module_entries.items():
        stored = _stored_dtype(reader, name, info["dtype"])
        # Integer and bool buffers (step counters, masks) keep their type; only floats are cast.
        out_dtype = dtype if stored.is_floating_point else stored
        planned.append(PlannedTensor(rename.get(name, name), name, tuple(info["shape"]), out_dtype, False))
    return planned


def split_into_shards(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Hugging Face's rule: fill a shard in order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def read_tensors(reader: CheckpointReader, planned: list[PlannedTensor]):
    """Yields (planned, tensor) one at a time, unmapping the input files every UNMAP_EVERY_BYTES."""
    mapped = 0
    for t in planned:
        yield t, read_tensor(reader, t)
        mapped += t.nbytes  # bytes written, which track the bytes read closely enough
        if mapped >= UNMAP_EVERY_BYTES:
            reader.close()
            mapped = 0
    reader.close()


def read_tensor(reader: CheckpointReader, t: PlannedTensor) -> torch.Tensor:
    tensor = reader.read_param(MASTER, t.source) if t.trainable else reader.read_module(t.source)
    if tuple(tensor.shape) != t.shape:
        raise CheckpointError(
            f"{reader.tag_dir}: {t.source!r} has shape {tuple(tensor.shape)} in its shard file "
            f"but {list(t.shape)} in {META}"
        )
    return tensor.to(t.dtype).contiguous()


def open_checkpoint_reader(checkpoint_dir: str | Path, tag: str | None) -> CheckpointReader:
    """A reader of SAVE_DIR's `tag` (default: `latest`), or of a tag directory given itself."""
    # Accept a tag directory itself (SAVE_DIR/global_step100) as well as SAVE_DIR plus a tag.
    path = Path(checkpoint_dir)
    if tag is None and (path / META).is_file():
        return CheckpointReader(path.parent, path.name)
    return CheckpointReader(path, tag)


TORCH_SAVE_SUFFIXES = (".bin", ".pt", ".pth")
"""Weights file names written with `torch.save` of plain tensors (DeepSpeed's pytorch_model.bin);
any other name is safetensors."""


def _output_names(output: Path) -> tuple[Path, str]:
    """(directory, single-file name): OUTPUT is a directory, or a file name ending in .safetensors
    (or .bin/.pt/.pth, written with torch.save)."""
    if output.suffix in (".safetensors", *TORCH_SAVE_SUFFIXES):
        return output.parent, output.name
    return output, WEIGHTS_NAME


def atomic_write_text(path: Path, text: str) -> None:
    """Writes `path` under a temporary name first, so readers never see half a file."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(text)
    os.replace(temp, path)


def _remove_stale_weights(directory: Path, file_name: str, written: list[Path]) -> None:
    # An old sharded export next to a new single file (or the reverse) would be loaded instead of it.
    stem, suffix = os.path.splitext(file_name)
    pattern = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(suffix)}(\.index\.json)?")
    for path in directory.iterdir():
        if pattern.fullmatch(path.name) and path not in written:
            path.unlink()


def write_consolidated_weights(
    reader: CheckpointReader,
    output: Path,
    dtype: torch.dtype,
    max_bytes: int,
    progress: ProgressCallback | None,
    rename: dict[str, str] | None = None,
) -> list[Path]:
    """`consolidate` on an open reader (shared by the Hugging Face export and zero_to_fp32);
    `rename` maps stored to written names. The file name's suffix picks the format (see
    TORCH_SAVE_SUFFIXES); above `max_bytes`, numbered shards plus an index."""
    directory, file_name = _output_names(output)
    stem, suffix = os.path.splitext(file_name)
    directory.mkdir(parents=True, exist_ok=True)
    planned = plan_tensors(reader, dtype, rename or {})
    shards = split_into_shards(planned, max_bytes)
    total_bytes = sum(t.nbytes for t in planned)
    if len(shards) == 1:
        names = [file_name]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    temps = [directory / f".{name}.tmp-{os.getpid()}" for name in names]
    done_tensors = done_bytes = 0
    try:
        for shard, temp in zip(shards, temps):
            tensors = {}
            for t, tensor in read_tensors(reader, shard):
                tensors[t.name] = tensor
                done_tensors, done_bytes = done_tensors + 1, done_bytes + t.nbytes
                if progress is not None:
                    progress(done_tensors, len(planned), done_bytes, total_bytes)
            if suffix in TORCH_SAVE_SUFFIXES:
                torch.save(tensors, temp)  # plain tensors only: loads with weights_only=True
            else:
                save_file(tensors, str(temp), metadata={"format": "pt"})
            os.chmod(temp, default_file_mode())  # save_file creates 0600 files
            del tensors
        written = [directory / name for name in names]
        for temp, path in zip(temps, written):
            os.replace(temp, path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
    if len(shards) > 1:
        weight_map = {t.name: name for shard, name in zip(shards, names) for t in shard}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        written.append(directory / f"{file_name}.index.json")
        atomic_write_text(written[-1], json.dumps(index, indent=2, sort_keys=True) + "\n")
    _remove_stale_weights(directory, file_name, written)
    return written


def consolidate(
    checkpoint_dir: str | Path,
    output: str | Path,
    tag: str | None = None,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str = "5GB",
    progress: ProgressCallback | None = None,
) -> list[Path]:
    """Writes the checkpoint's full model as safetensors; returns the files written.

    `output` is a directory (getting `model.safetensors`) or a `*.safetensors` file name.
    A model larger than `max_shard_size` is split Hugging Face style into
    `model-00001-of-0000N.safetensors`... plus `model.safetensors.index.json`.
    `checkpoint_dir` is a save directory (the tag defaults to `latest`) or a tag directory.
    Trainable parameters come from their fp32 masters cast to `dtype`; frozen
    parameters and buffers as stored (floats cast to `dtype`). Tied weights appear once.
    """
    out_dtype, max_bytes = resolve_dtype(dtype), parse_size(max_shard_size)
    with open_checkpoint_reader(checkpoint_dir, tag) as reader:
        return write_consolidated_weights(reader, Path(output), out_dtype, max_bytes, progress)


def load_consolidated_state_dict(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's full model in memory: fp32 tensors (integer buffers keep their type), by parameter name."""
    with open_checkpoint_reader(checkpoint_dir, tag) as reader:
        planned = plan_tensors(reader, torch.float32, {})
        return {t.name: tensor for t, tensor in read_tensors(reader, planned)}
