"""DeepSpeed's `zero_to_fp32` on zerotrain checkpoints: its functions, names and script arguments.

Code and scripts written for DeepSpeed call `deepspeed.utils.zero_to_fp32` (or run the
`zero_to_fp32.py` placed in every checkpoint folder) to get a model's fp32 weights out of
ZeRO shards. The same calls work here on zerotrain's format, at any stage and world size:

    get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False)
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False)
    load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None)
    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]
                           [--exclude_frozen_parameters] [-d]

`checkpoint_dir` holds `latest` and the tag folders; the tag defaults to the one `latest` names.
Reading is consolidate.py's (one tensor at a time); output is what DeepSpeed writes:
`pytorch_model.bin` (torch.save of plain tensors, loadable with `weights_only=True`) or
`model.safetensors`, split Hugging Face style with an index json above `max_shard_size`.
An OUTPUT ending in .bin/.pt/.pth/.safetensors (and not an existing folder) is the older
script's output *file*: that one file is written, unsharded.

Differences from DeepSpeed: every floating tensor comes out fp32 (DeepSpeed leaves frozen
parameters in their 16-bit dtype); a tied weight appears once, under the name it was saved
under (DeepSpeed also lists its other names), which `load_state_dict(strict=False)` and
Hugging Face loaders accept.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from zerotrain.checkpoint.consolidate import (
    UNMAP_EVERY_BYTES, PlannedTensor, ProgressCallback, open_checkpoint_reader, plan_tensors, read_tensor,
    resolve_dtype, write_consolidated_weights,
)
from zerotrain.checkpoint.deepspeed_layout import is_deepspeed_tag_dir
from zerotrain.checkpoint.errors import CheckpointError, CorruptCheckpointError
from zerotrain.config.byte_sizes import parse_byte_size
from zerotrain.checkpoint.layout import LATEST, META
from zerotrain.checkpoint.reader import CheckpointReader, checkpoint_tags

log = logging.getLogger("zerotrain")

BIN_WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
# meta.json marks each entry stored whole under "module/" as a frozen parameter or a buffer with this key.
PARAMETER_FLAG = "is_parameter"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No zerotrain checkpoint where one was asked for; the message says what was looked for, and where.

    A FileNotFoundError too, as DeepSpeed raises for a missing tag folder.
    """


# --- finding and opening the checkpoint -------------------------------------------------------


def open_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, exclude_frozen_parameters: bool = False
) -> CheckpointReader:
    """A reader of CHECKPOINT_DIR/TAG (TAG from `latest` by default), or of a tag folder given itself.

    With `exclude_frozen_parameters` the reader leaves out frozen parameters (buffers stay).
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint folder {root} does not exist")
    if tag is None and not (root / LATEST).is_file() and not (root / META).is_file() and not is_deepspeed_tag_dir(root):
        raise CheckpointNotFoundError(_nothing_found_message(root))
    try:
        reader = open_checkpoint_reader(root, tag)
    except CheckpointError as error:
        hint = _deepspeed_format_hint(root)
        if hint:
            raise CheckpointError(f"{error}. {hint}") from error
        raise
    if exclude_frozen_parameters:
        _drop_frozen_parameters(reader)
    return reader


def _nothing_found_message(root: Path) -> str:
    tags = checkpoint_tags(root)
    if tags:
        return (
            f"no `{LATEST}` file in {root} to name the checkpoint to convert; "
            f"tags there: {', '.join(tags)}: pass one with -t/--tag (tag=...)"
        )
    message = (
        f"no zerotrain checkpoint in {root}: looked for {root / LATEST} (naming the newest tag) and for "
        f"tag folders (such as global_step100/) holding {META}, and found neither. Give the folder "
        "engine.save_checkpoint() wrote into"
    )
    hint = _deepspeed_format_hint(root)
    return f"{message}. {hint}" if hint else message


def _deepspeed_format_hint(root: Path) -> str | None:
    """A note for a checkpoint DeepSpeed itself wrote, which this reader does not read."""
    if any(root.glob("*model_states.pt")) or any(root.glob("*/*model_states.pt")):
        return "Its *model_states.pt files are DeepSpeed's own format: convert it with DeepSpeed's zero_to_fp32.py"
    return None


def _drop_frozen_parameters(reader: CheckpointReader) -> None:
    entries = reader.module_entries
    if entries and not all(PARAMETER_FLAG in info for info in entries.values()):
        # Older checkpoints do not say which whole-stored tensors are parameters: keeping them all loses nothing.
        log.warning(
            "exclude_frozen_parameters: %s does not record which of its %d whole-stored tensors are frozen "
            "parameters and which are buffers; keeping them all", reader.tag_dir, len(entries),
        )
        return
    reader.module_entries = {name: info for name, info in entries.items() if not info[PARAMETER_FLAG]}


# --- lazy tensors -------------------------------------------------------------------------------


class _SharedReader:
    """The reader behind a state dict's lazy tensors; unmaps its files every so many bytes read."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._mapped = 0

    def read(self, planned: PlannedTensor) -> torch.Tensor:
        tensor = read_tensor(self.reader, planned)
        self._mapped += planned.nbytes
        if self._mapped >= UNMAP_EVERY_BYTES:  # mapped pages count as this process's memory until unmapped
            self.reader.close()
            self._mapped = 0
        return tensor


class LazyCheckpointTensor:
    """One tensor of a checkpoint, read (fp32) only when `.contiguous()` is called, as DeepSpeed's lazy mode.

    `shape`, `dtype` and `numel()` are known without reading.
    """

    def __init__(self, source: _SharedReader, planned: PlannedTensor) -> None:
        self._source = source
        self._planned = planned

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._planned.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._planned.dtype

    def numel(self) -> int:
        return self.shape.numel()

    def contiguous(self) -> torch.Tensor:
        """The tensor itself, read from the checkpoint now (a fresh CPU tensor each call)."""
        return self._source.read(self._planned)

    def __repr__(self) -> str:
        return f"LazyCheckpointTensor({self._planned.source!r}, shape={list(self.shape)}, dtype={self.dtype})"


# --- DeepSpeed's functions ------------------------------------------------------------------------


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor] | dict[str, LazyCheckpointTensor]:
    """The checkpoint's full model as a state dict of fp32 CPU tensors (integer buffers keep their type).

    `checkpoint_dir` holds `latest` and the tag folders (a tag folder itself works too);
    `tag` defaults to the one `latest` names. `exclude_frozen_parameters` leaves out
    parameters with requires_grad=False (buffers stay). With `lazy_mode` the values are
    LazyCheckpointTensor objects, each read only when its `.contiguous()` is called, so a
    caller that handles one tensor at a time never holds the model (DeepSpeed's contract).
    """
    reader = open_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    source = _SharedReader(reader)
    lazy = {t.name: LazyCheckpointTensor(source, t) for t in plan_tensors(reader, torch.float32, {})}
    if lazy_mode:
        return lazy
    try:
        return {name: tensor.contiguous() for name, tensor in lazy.items()}
    finally:
        reader.close()


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike | None = None,
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    output_file: str | os.PathLike | None = None,
    progress: ProgressCallback | None = None,
) -> list[Path]:
    """Writes the checkpoint's weights as DeepSpeed does, floats in `dtype`; returns the files written.

    Into `output_dir`: `pytorch_model.bin` (torch.save of plain tensors), or with
    `safe_serialization` `model.safetensors`; above `max_shard_size` (None: never) split into
    `pytorch_model-00001-of-0000N.bin`... plus `pytorch_model.bin.index.json` (safetensors
    likewise). An output path ending in .bin/.pt/.pth/.safetensors that is not a folder,
    or `output_file=` (the older keyword), is one file, written unsharded as older DeepSpeed did.
    Files appear whole (written under temporary names, then renamed).
    """
    out_dtype = resolve_dtype(dtype)
    target, single_file = _output_target(output_dir, output_file, safe_serialization)
    max_bytes = sys.maxsize if single_file or max_shard_size is None else parse_byte_size(max_shard_size)
    with open_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters) as reader:
        return write_consolidated_weights(reader, target, out_dtype, max_bytes, progress)  # the suffix picks the format


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike | None = None,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    output_file: str | os.PathLike | None = None,
) -> list[Path]:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's long-standing name)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag,
        exclude_frozen_parameters, output_file=output_file,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> torch.nn.Module:
    """Moves `model` to the CPU, loads the checkpoint's fp32 weights into it and returns it.

    Loading is not strict, as in DeepSpeed (a tied weight is stored under one of its names);
    names the model does not have are logged. The model must be an ordinary (not ZeRO-3
    partitioned) module: after this it no longer belongs to an engine.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        log.warning("load_state_dict_from_zero_checkpoint: the model has no %s", ", ".join(result.unexpected_keys))
    return model


# --- writing torch files --------------------------------------------------------------------------


def _output_target(output_dir, output_file, safe_serialization: bool) -> tuple[Path, bool]:
    """(the weights file to write, or its name in the output folder; whether it is the older single-file form)."""
    if (output_dir is None) == (output_file is None):
        raise TypeError("pass output_dir (a folder), or output_file (one file, as older DeepSpeed took)")
    path = Path(output_file if output_file is not None else output_dir)
    if output_file is not None or (path.suffix in _FILE_SUFFIXES and not path.is_dir()):
        if safe_serialization and path.suffix != ".safetensors":
            raise ValueError(f"output file {path} is not a .safetensors name, but safetensors was asked for")
        return path, True
    return path / (SAFE_WEIGHTS_NAME if safe_serialization else BIN_WEIGHTS_NAME), False


# --- the script -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's zero_to_fp32.py arguments."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Writes the fp32 weights of a zerotrain checkpoint folder as DeepSpeed's zero_to_fp32.py does.",
    )
    parser.add_argument("checkpoint_dir", help="folder holding `latest` and the tag folders, e.g. path/checkpoint-12")
    parser.add_argument(
        "output_dir",
        help="folder for the weights (pytorch_model.bin or model.safetensors); a name ending in .bin, .pt, .pth "
        "or .safetensors that is not a folder is one output file (the older form)",
    )
    parser.add_argument(
        "--max_shard_size", default="5GB",
        help="split the weights into files of at most this size (e.g. 5GB, 500MB); default 5GB",
    )
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: from `latest`)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="print progress after every tensor read")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the zero_to_fp32.py command line; returns the exit status (0, or 2 with the reason on stderr)."""
    args = build_parser().parse_args(argv)
    progress = _print_each_tensor if args.debug else None
    try:
        written = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir, args.output_dir, torch.float32, args.max_shard_size, args.safe_serialization,
            args.tag, args.exclude_frozen_parameters, progress=progress,
        )
    except CorruptCheckpointError as error:  # point at the previous tag with this same command
        command = _same_command_for_tag(args, error.previous_tag) if error.previous_tag else None
        print(f"zero_to_fp32.py: error: {error.with_command(command)}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError, OSError) as error:
        print(f"zero_to_fp32.py: error: {error}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in written if not p.name.endswith(".json"))
    print(f"Saved fp32 weights ({size / 1e6:.1f} MB) to {', '.join(str(p) for p in written)}")
    return 0


def _same_command_for_tag(args: argparse.Namespace, tag: str) -> str:
    """This command line again, for checkpoint tag `tag`."""
    words = ["python", "zero_to_fp32.py", args.checkpoint_dir, args.output_dir, "--tag", tag]
    if args.max_shard_size != "5GB":
        words += ["--max_shard_size", args.max_shard_size]
    for flag in ("safe_serialization", "exclude_frozen_parameters"):
        if getattr(args, flag):
            words.append(f"--{flag}")
    return shlex.join(words)


def _print_each_tensor(tensors_done: int, tensors_total: int, bytes_done: int, bytes_total: int) -> None:
    print(f"[{tensors_done}/{tensors_total}] {bytes_done / 1e6:.1f} of {bytes_total / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
