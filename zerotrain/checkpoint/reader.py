"""CheckpointReader: reads any element range of any parameter from a saved checkpoint.

Files are opened lazily with safetensors and only the requested slices are read,
so a loader touches just what its shards need and consolidation streams one
tensor at a time. What the files claim is checked before it is used: the tag in
`latest` must be a folder name in the checkpoint folder, meta.json must hold together
(layout.read_meta), and each tensor's size in its shard file must be the one meta.json
gives before any memory is taken for it.
"""

from __future__ import annotations

import glob
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zerotrain.checkpoint.errors import CheckpointError, CorruptCheckpointError
from zerotrain.checkpoint.layout import (
    LATEST, META, MODULE, ParamSlice, read_meta, shard_file, slice_key, tag_name_problem,
)

MAX_LATEST_BYTES = 4096
"""`latest` holds one tag name; a larger file is not a `latest` and is not read whole."""
# What the shard files store a slice (fp32 master or optimizer state) as, in safetensors' words.
_SLICE_DTYPE = "F32"


def resolve_tag_dir(load_dir: str | Path, tag: str | None) -> Path:
    """The directory of `tag` (or of the tag named in `latest`) under `load_dir`.

    Either must name a folder directly inside `load_dir`: a path, `..` or a name starting
    with '.' is refused with a CheckpointError naming where it came from.
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{latest} not found: pass a tag, or save a checkpoint into {root} first")
        tag = read_latest(latest)
    else:
        problem = tag_name_problem(str(tag))
        if problem:
            raise CheckpointError(
                f"checkpoint tag {str(tag)!r:.200} cannot be used: {problem}; a tag is the name of one folder in "
                f"{root} (tags there: {', '.join(checkpoint_tags(root)) or 'none'})"
            )
    tag_dir = root / str(tag)
    if not tag_dir.is_dir():
        # A save killed while replacing an existing tag leaves the old one parked aside.
        parked = sorted(root.glob(f".old-{glob.escape(str(tag))}-*"))
        if parked:
            return parked[-1]
        available = checkpoint_tags(root)
        raise CheckpointError(f"no checkpoint tag {tag!r} in {root} (available: {', '.join(available) or 'none'})")
    return tag_dir


def read_latest(latest: Path) -> str:
    """The tag the `latest` file at `latest` names, checked to be a plain folder name.

    Reads at most MAX_LATEST_BYTES; a file that is too large, not UTF-8, empty, several lines,
    or names a path raises a CheckpointError naming the file and the tags beside it.
    """
    def refused(problem: str) -> CheckpointError:
        tags = ", ".join(checkpoint_tags(latest.parent)) or "none"
        return CheckpointError(f"{latest} {problem}; write the name of one tag folder of {latest.parent} into it "
                               f"(tags there: {tags}), or pass the tag to load")

    try:
        with open(latest, "rb") as file:
            data = file.read(MAX_LATEST_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {latest}: {e.strerror or e}") from e
    if len(data) > MAX_LATEST_BYTES:
        raise refused(f"is larger than {MAX_LATEST_BYTES} bytes, so it names no tag")
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise refused(f"is not UTF-8 text (byte {e.start} cannot be decoded)") from None
    problem = tag_name_problem(tag)
    if problem:
        raise refused(f"names the tag {tag!r:.120}, which cannot be a tag: {problem}")
    return tag


def checkpoint_tags(root: Path) -> list[str]:
    """The checkpoint tags in `root` (folders with a meta.json), oldest step first: not the
    `hf` export or a tag's `.old-*` copy, and `step10` after `step9`."""
    tags = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META).is_file()]
    return [p.name for p in sorted(tags, key=lambda p: (_saved_step(p) is None, _saved_step(p) or 0, p.name))]


class CheckpointReader:
    """Random access to the parameters and optimizer state of one saved checkpoint."""

    def __init__(self, load_dir: str | Path, tag: str | None = None) -> None:
        self.tag_dir = resolve_tag_dir(load_dir, tag)
        try:
            self.meta = read_meta(self.tag_dir)
        except CheckpointError as error:
            if isinstance(error.__cause__, (ValueError, UnicodeDecodeError)):  # meta.json is there but garbled
                raise self.corrupt(str(error)) from error
            raise
        self.params: dict[str, dict] = self.meta["params"]
        self.kinds: list[str] = self.meta["kinds"]
        self.module_entries: dict[str, dict] = self.meta["module"]
        self._slices: dict[str, list[ParamSlice]] = defaultdict(list)
        for file, entries in self.meta["files"].items():
            for name, start, numel in entries:
                self._slices[name].append(ParamSlice(name, start, numel, file))
        for slices in self._slices.values():
            slices.sort(key=lambda s: s.start)
        self._open_files: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._open_files.clear()

    def _file(self, file: str):
        if file not in self._open_files:
            path = self.tag_dir / file
            if not path.is_file():
                raise self.corrupt(f"missing shard file {path}")
            try:
                self._open_files[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise self.corrupt(f"cannot read {path}: truncated or corrupt ({e})") from e
        return self._open_files[file]

    def _stored(self, file: str, key: str) -> tuple[list[int], str]:
        """The shape and safetensors dtype (e.g. "F32") of tensor `key` in `file`, from its header only."""
        handle = self._file(file)
        path = self.tag_dir / file
        try:
            stored = handle.get_slice(key)
            return list(stored.get_shape()), stored.get_dtype()
        except Exception as e:
            if key not in handle.keys():  # looked up only now: listing every key costs as much as the header
                missing = f"{path} has no tensor {key!r:.200}, which {META} lists (a shard of another save?)"
                raise self.corrupt(missing) from e
            raise self.corrupt(f"cannot read {key!r} from {path}: truncated or corrupt ({e})") from e

    def _read(self, file: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        try:
            handle = self._file(file)
            return handle.get_tensor(key) if lo is None else handle.get_slice(key)[lo:hi]
        except CheckpointError:
            raise
        except Exception as e:
            raise self.corrupt(f"cannot read {key!r} from {self.tag_dir / file}: truncated or corrupt ({e})") from e

    def corrupt(self, problem: str) -> CorruptCheckpointError:
        """The error for a bad file of this checkpoint, pointing at the previous intact tag beside it."""
        return CorruptCheckpointError(problem, self.tag_dir.parent, previous_tag(self.tag_dir))

    def numel(self, name: str) -> int:
        shape = self.params[name]["shape"]
        n = 1
        for d in shape:
            n *= d
        return n

    def read_range(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened parameter `name`'s `kind` ("master" or an optimizer state)."""
        if name not in self.params:
            raise CheckpointError(f"{self.tag_dir}: no parameter {name!r} in this checkpoint")
        pieces = []
        for s in self._slices[name]:
            a, b = max(start, s.start), min(end, s.start + s.numel)
            if a < b:
                pieces.append((s, a, b))
        if sum(b - a for _, a, b in pieces) != end - start:
            raise CheckpointError(
                f"{self.tag_dir}: elements [{start}, {end}) of {name!r} are not all present in the shard files "
                "(a missing or foreign shard?)"
            )
        for s, _, _ in pieces:  # before taking memory: the sizes the files hold, not the ones meta.json claims
            key = slice_key(kind, name, s.start)
            shape, dtype = self._stored(s.file, key)
            if shape != [s.numel] or dtype != _SLICE_DTYPE:
                raise self.corrupt(
                    f"{self.tag_dir / s.file}: tensor {key!r:.200} is {dtype} of shape {shape}, but {META} lists "
                    f"a slice of {s.numel} elements, stored as {_SLICE_DTYPE} (float32); the shard file and {META} "
                    "do not belong together"
                )
        out = torch.empty(end - start, dtype=torch.float32)
        for s, a, b in pieces:
            piece = self._read(s.file, slice_key(kind, name, s.start), a - s.start, b - s.start)
            out[a - start : b - start].copy_(piece)
        return out

    def read_param(self, kind: str, name: str) -> torch.Tensor:
        """The whole parameter `name` as stored under `kind`, in its shape (fp32)."""
        return self.read_range(kind, name, 0, self.numel(name)).view(self.params[name]["shape"])

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or persistent buffer, stored whole by rank 0, checked against meta.json."""
        info = self.module_entries.get(name)
        if info is None:
            raise CheckpointError(f"{self.tag_dir}: no frozen parameter or buffer {name!r} in this checkpoint")
        file, key = shard_file(0), slice_key(MODULE, name, 0)
        shape, _ = self._stored(file, key)
        if shape != list(info["shape"]):
            raise self.corrupt(
                f"{self.tag_dir / file}: tensor {key!r:.200} has shape {shape}, but {META} gives {info['shape']}; "
                f"the shard file and {META} do not belong together"
            )
        tensor = self._read(file, key)
        wanted = getattr(torch, info["dtype"].removeprefix("torch."), None)
        if tensor.dtype != wanted:
            raise self.corrupt(
                f"{self.tag_dir / file}: tensor {key!r:.200} is {str(tensor.dtype).removeprefix('torch.')}, but "
                f"{META} gives {info['dtype']!r:.40}; the shard file and {META} do not belong together"
            )
        return tensor


def previous_tag(tag_dir: Path) -> str | None:
    """The newest intact tag saved before `tag_dir` in the same folder, or None.

    "Before" goes by the step meta.json records (or the number in the tag's name);
    without either, by modification time.  Intact: meta.json reads and every shard file opens.
    """
    broken_step = _saved_step(tag_dir)
    candidates = []
    try:
        for other in tag_dir.parent.iterdir():
            if other.name.startswith(".") or other == tag_dir or not other.is_dir():
                continue
            step = _saved_step(other)
            if broken_step is not None and step is not None:
                if step < broken_step:
                    candidates.append(((step, other.stat().st_mtime), other))
            elif other.stat().st_mtime < tag_dir.stat().st_mtime:
                candidates.append(((-1, other.stat().st_mtime), other))
    except OSError:  # a folder we cannot list offers no fallback; the original error still stands
        return None
    for _, other in sorted(candidates, key=lambda c: c[0], reverse=True):
        if _intact(other):
            return other.name
    return None


def _saved_step(tag_dir: Path) -> int | None:
    try:
        return int(json.loads((tag_dir / META).read_text())["counters"]["global_steps"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):  # garbled: go by the name
        digits = re.findall(r"\d+", tag_dir.name)
        return int(digits[-1]) if digits else None


def _intact(tag_dir: Path) -> bool:
    """meta.json reads, and every shard file it lists opens (headers only: cheap at any size)."""
    try:
        meta = read_meta(tag_dir)  # checked, so its file names are plain names inside tag_dir
        for file in meta["files"]:
            with safe_open(str(tag_dir / file), framework="pt", device="cpu"):
                pass
    except Exception:  # noqa: BLE001 - any failure means this tag is no fallback
        return False
    return True
