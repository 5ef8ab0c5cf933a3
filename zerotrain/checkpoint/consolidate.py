"""Leaving zerotrain: a checkpoint's full model as safetensors files or an in-memory state dict.

A checkpoint stores each parameter's fp32 master in slices spread over the ranks'
shard files. Consolidation plans the output files from the shapes in meta.json,
then reads one tensor at a time and writes each output file as soon as its
tensors are collected, so memory stays near one output shard, never the model.
The Hugging Face directory export builds on this in hf_export.py.

Every output is written where no loader looks and published at the end (`staged_output`),
so a run killed at any moment, SIGKILL included, leaves no partial output that looks
complete, and the checkpoint read is never written to.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.deepspeed_layout import DeepSpeedCheckpoint, find_deepspeed_tag_dir
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.file_mode import default_file_mode
from zerotrain.checkpoint.layout import MASTER, META
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.comm.fault_points import fault_point
from zerotrain.config.byte_sizes import parse_byte_size
from zerotrain.system.durable_files import fsync_path, rename_durably
from zerotrain.system.processes import process_alive

WEIGHTS_NAME = "model.safetensors"
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}

# The reader maps shard files, and pages read through a map count as this process's memory
# until it is unmapped: closing the reader every so many bytes keeps them out of the peak.
UNMAP_EVERY_BYTES = 64 * 2**20

# progress(tensors_done, tensors_total, bytes_done, bytes_total), called after each tensor is read.
ProgressCallback = Callable[[int, int, int, int], None]


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


def open_checkpoint_reader(checkpoint_dir: str | Path, tag: str | None) -> CheckpointReader | DeepSpeedCheckpoint:
    """A reader of SAVE_DIR's `tag` (default: `latest`), or of a tag directory given itself;
    zerotrain's format or DeepSpeed's own (deepspeed_layout.py), whichever the folder holds."""
    # Accept a tag directory itself (SAVE_DIR/global_step100) as well as SAVE_DIR plus a tag.
    path = Path(checkpoint_dir)
    if tag is None and (path / META).is_file():
        return CheckpointReader(path.parent, path.name)
    deepspeed_tag_dir = find_deepspeed_tag_dir(path, tag)
    if deepspeed_tag_dir is not None:
        return DeepSpeedCheckpoint(deepspeed_tag_dir)
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


CONFIG_NAME = "config.json"  # a Hugging Face model folder's: with the weights, what makes it loadable
STAGE_NAME = "consolidate"  # the staging folder inside an existing output folder: .consolidate.tmp-HOST-PID
_TEMP = re.compile(r"\.(?P<name>.+)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)")
"""A staging folder `.NAME.tmp-HOST-PID`, or an earlier version's temporary file `.NAME.tmp-PID`."""


def _temp_name(name: str) -> str:
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}"


def _weights_pattern(file_name: str) -> re.Pattern:
    """Every weights file name of one output, in either layout: FILE, its shards, and its index."""
    stem, suffix = os.path.splitext(file_name)
    return re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(suffix)}(\.index\.json)?")


def _is_marker(name: str) -> bool:
    """Files that say a folder holds a whole model: the shard index and the Hugging Face config."""
    return name.endswith(".index.json") or name == CONFIG_NAME


def _remove_leftovers(directory: Path, file_name: str) -> None:
    """Removes what runs killed on this machine left for `directory`: their staging folders beside it
    or in it, and an earlier version's temporary files in it. A live run's, or another machine's on a
    shared file system, are left alone."""
    host, ours = socket.gethostname(), _weights_pattern(file_name)
    places = [(directory.parent, lambda name: name == directory.name)]
    if directory.is_dir():
        places.append((directory, lambda name: name in (STAGE_NAME, CONFIG_NAME) or ours.fullmatch(name)))
    for folder, wanted in places:
        for path in folder.glob(".*.tmp-*") if folder.is_dir() else []:
            match = _TEMP.fullmatch(path.name)
            if not match or not wanted(match["name"]) or match["host"] not in (None, host):
                continue
            if process_alive(int(match["pid"])):
                continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


@contextmanager
def staged_output(directory: Path, file_name: str) -> Iterator[Path]:
    """A private folder to write `directory`'s files into; they appear when the block ends without error.

    A process killed at any moment (SIGKILL included) leaves no partial output that looks complete:
    - a `directory` that does not exist yet is written whole as its hidden sibling
      `.NAME.tmp-HOST-PID` and renamed into place at the end: until then there is no `directory`;
    - into an existing one (an earlier output, or the folder a file name points into) the files are
      staged in its `.consolidate.tmp-HOST-PID` and then moved in: first the old index and config.json
      and the weights of the other layout (`file_name` names the weights) go, then the weight files
      and the rest move in, the index and config.json last. Until then the folder lacks what marks a
      model complete; a single weights file is replaced in one rename.
    Files are fsynced before they are published. An error removes the staged files and leaves the
    old output as it was; leftovers of killed runs on this machine are removed when the next starts.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder", str(directory))
    _remove_leftovers(directory, file_name)
    existing = directory.is_dir()
    if existing:
        stage = directory / _temp_name(STAGE_NAME)
    else:
        directory.parent.mkdir(parents=True, exist_ok=True)
        stage = directory.parent / _temp_name(directory.name)
    stage.mkdir()
    try:
        yield stage
        for path in stage.iterdir():
            fsync_path(path)
        fsync_path(stage)
        if existing:
            _publish_into(stage, directory, _weights_pattern(file_name))
        else:
            rename_durably(stage, directory)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish_into(stage: Path, directory: Path, weights: re.Pattern) -> None:
    """Moves the staged files into the existing `directory` in the order staged_output describes."""
    staged = sorted(p.name for p in stage.iterdir())
    # An old weights file of the other layout would be loaded instead of the new ones.
    stale = [p.name for p in directory.iterdir() if weights.fullmatch(p.name) and p.name not in staged]
    for name in sorted({n for n in [*staged, *stale] if _is_marker(n)}) + stale:
        (directory / name).unlink(missing_ok=True)
    data, markers = [n for n in staged if not _is_marker(n)], [n for n in staged if _is_marker(n)]
    for name in data + sorted(markers, key=lambda n: n == CONFIG_NAME):  # the config last of all
        os.replace(stage / name, directory / name)
    fsync_path(directory)


def stage_weights(
    reader: CheckpointReader,
    stage: Path,
    file_name: str,
    dtype: torch.dtype,
    max_bytes: int,
    progress: ProgressCallback | None,
    rename: dict[str, str] | None = None,
) -> list[str]:
    """Writes the weights into the staging folder `stage` (see staged_output); returns the file names.

    One file `file_name`, or above `max_bytes` numbered shards plus an index; the suffix picks the
    format (see TORCH_SAVE_SUFFIXES). `rename` maps stored to written names."""
    stem, suffix = os.path.splitext(file_name)
    planned = plan_tensors(reader, dtype, rename or {})
    shards = split_into_shards(planned, max_bytes)
    total_bytes = sum(t.nbytes for t in planned)
    if len(shards) == 1:
        names = [file_name]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    done_tensors = done_bytes = 0
    for i, (shard, name) in enumerate(zip(shards, names)):
        tensors = {}
        for t, tensor in read_tensors(reader, shard):
            tensors[t.name] = tensor
            done_tensors, done_bytes = done_tensors + 1, done_bytes + t.nbytes
            if progress is not None:
                progress(done_tensors, len(planned), done_bytes, total_bytes)
        path = stage / name
        if suffix in TORCH_SAVE_SUFFIXES:
            torch.save(tensors, path)  # plain tensors only: loads with weights_only=True
        else:
            save_file(tensors, str(path), metadata={"format": "pt"})
        os.chmod(path, default_file_mode())  # save_file creates 0600 files
        del tensors
        if i == 0:
            fault_point("consolidate")  # the first output file written, the others not
    if len(shards) > 1:
        weight_map = {t.name: name for shard, name in zip(shards, names) for t in shard}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        names.append(f"{file_name}.index.json")
        (stage / names[-1]).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def write_consolidated_weights(
    reader: CheckpointReader,
    output: Path,
    dtype: torch.dtype,
    max_bytes: int,
    progress: ProgressCallback | None,
    rename: dict[str, str] | None = None,
) -> list[Path]:
    """`consolidate` on an open reader (shared by zero_to_fp32); `rename` maps stored to written
    names. The file name's suffix picks the format (see TORCH_SAVE_SUFFIXES); above `max_bytes`,
    numbered shards plus an index. Published as staged_output says."""
    directory, file_name = _output_names(output)
    with staged_output(directory, file_name) as stage:
        names = stage_weights(reader, stage, file_name, dtype, max_bytes, progress, rename)
    return [directory / name for name in names]


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
    out_dtype, max_bytes = resolve_dtype(dtype), parse_byte_size(max_shard_size)
    with open_checkpoint_reader(checkpoint_dir, tag) as reader:
        return write_consolidated_weights(reader, Path(output), out_dtype, max_bytes, progress)


def load_consolidated_state_dict(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's full model in memory: fp32 tensors (integer buffers keep their type), by parameter name."""
    with open_checkpoint_reader(checkpoint_dir, tag) as reader:
        planned = plan_tensors(reader, torch.float32, {})
        return {t.name: tensor for t, tensor in read_tensors(reader, planned)}
