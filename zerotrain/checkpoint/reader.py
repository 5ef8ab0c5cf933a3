"""CheckpointReader: reads any element range of any parameter from a saved checkpoint.

Files are opened lazily with safetensors and only the requested slices are read,
so a loader touches just what its shards need and consolidation streams one
tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zerotrain.checkpoint.errors import CheckpointError, CorruptCheckpointError
from zerotrain.checkpoint.layout import FORMAT, LATEST, META, MODULE, ParamSlice, read_meta, shard_file, slice_key


def resolve_tag_dir(load_dir: str | Path, tag: str | None) -> Path:
    """The directory of `tag` (or of the tag named in `latest`) under `load_dir`."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{latest} not found: pass a tag, or save a checkpoint into {root} first")
        tag = latest.read_text().strip()
    tag_dir = root / str(tag)
    if not tag_dir.is_dir():
        # A save killed while replacing an existing tag leaves the old one parked aside.
        parked = sorted(root.glob(f".old-{tag}-*"))
        if parked:
            return parked[-1]
        available = checkpoint_tags(root)
        raise CheckpointError(f"no checkpoint tag {tag!r} in {root} (available: {', '.join(available) or 'none'})")
    return tag_dir


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
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for s in self._slices[name]:
            a, b = max(start, s.start), min(end, s.start + s.numel)
            if a >= b:
                continue
            piece = self._read(s.file, slice_key(kind, name, s.start), a - s.start, b - s.start)
            out[a - start : b - start].copy_(piece)
            covered += b - a
        if covered != end - start:
            raise CheckpointError(
                f"{self.tag_dir}: elements [{start}, {end}) of {name!r} are not all present in the shard files "
                "(a missing or foreign shard?)"
            )
        return out

    def read_param(self, kind: str, name: str) -> torch.Tensor:
        """The whole parameter `name` as stored under `kind`, in its shape (fp32)."""
        return self.read_range(kind, name, 0, self.numel(name)).view(self.params[name]["shape"])

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or persistent buffer, stored whole by rank 0."""
        return self._read(shard_file(0), slice_key(MODULE, name, 0))


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
    except (OSError, ValueError, KeyError, TypeError):
        digits = re.findall(r"\d+", tag_dir.name)
        return int(digits[-1]) if digits else None


def _intact(tag_dir: Path) -> bool:
    """meta.json reads, and every shard file it lists opens (headers only: cheap at any size)."""
    try:
        meta = json.loads((tag_dir / META).read_text())
        if meta.get("format") != FORMAT:
            return False
        for file in meta["files"]:
            with safe_open(str(tag_dir / file), framework="pt", device="cpu"):
                pass
    except Exception:  # noqa: BLE001 - any failure means this tag is no fallback
        return False
    return True
