"""CheckpointReader: reads any element range of any parameter from a saved checkpoint.

Files are opened lazily with safetensors and only the requested slices are read,
so a loader touches just what its shards need and consolidation streams one
tensor at a time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.layout import LATEST, MODULE, ParamSlice, read_meta, shard_file, slice_key


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
        available = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise CheckpointError(f"no checkpoint tag {tag!r} in {root} (available: {', '.join(available) or 'none'})")
    return tag_dir


class CheckpointReader:
    """Random access to the parameters and optimizer state of one saved checkpoint."""

    def __init__(self, load_dir: str | Path, tag: str | None = None) -> None:
        self.tag_dir = resolve_tag_dir(load_dir, tag)
        self.meta = read_meta(self.tag_dir)
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
                raise CheckpointError(f"missing shard file {path}")
            try:
                self._open_files[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot read {path}: truncated or corrupt ({e})") from e
        return self._open_files[file]

    def _read(self, file: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        try:
            handle = self._file(file)
            return handle.get_tensor(key) if lo is None else handle.get_slice(key)[lo:hi]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {key!r} from {self.tag_dir / file}: truncated or corrupt ({e})") from e

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
