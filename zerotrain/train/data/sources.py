"""Which files ``data.path`` names and in which format each is read.

``data.path`` may be one file, a directory written by ``datasets``'
``save_to_disk``, a directory holding such files and directories (searched
recursively), or a glob pattern (``data/*.jsonl``, ``shards/**/*.parquet``)
matching any of those.  Inputs are always taken in sorted order so every rank
and every run sees the same data.

With ``data.format: auto`` a file's format comes from its extension:

* ``.txt``, ``.text``, ``.md`` -> ``text``; ``.jsonl``, ``.ndjson``, ``.json`` -> ``jsonl``;
  ``.parquet`` -> ``parquet``; a ``save_to_disk`` directory -> ``arrow``.
* A single file with any other extension is an error (set ``data.format``); in
  a directory such files (and hidden ones) are skipped, so a README or a
  ``.gitattributes`` next to the data does no harm.

With an explicit format every non-hidden file under a directory is read in it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from zerotrain.train.data.errors import DataError

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow", "synthetic")
FILE_FORMATS = ("text", "jsonl", "parquet")

EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}

_GLOB_CHARS = set("*?[")

# Files `save_to_disk` writes: a Dataset directory has the first two, a DatasetDict the last.
_DATASET_MARKERS = ("state.json", "dataset_info.json")
_DATASET_DICT_MARKER = "dataset_dict.json"


@dataclass(frozen=True)
class Source:
    """One input: a file, or a ``save_to_disk`` directory, and the format to read it in."""

    path: Path
    format: str

    def files(self) -> list[Path]:
        """The files whose bytes make up this input (all of them, for a saved dataset)."""
        if self.path.is_dir():
            return sorted(p for p in self.path.rglob("*") if p.is_file())
        return [self.path]

    @property
    def size(self) -> int:
        """Bytes on disk, the unit of the tokenization progress bar."""
        return sum(p.stat().st_size for p in self.files())


def check_format(fmt: str) -> str:
    """``fmt`` if zerotrain knows it; otherwise a DataError listing the choices."""
    fmt = (fmt or "auto").lower()
    if fmt not in FORMATS:
        raise DataError(f"data.format {fmt!r} is not one of {', '.join(FORMATS)}.")
    return fmt


def is_saved_dataset(path: Path) -> bool:
    """True for a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    if (path / _DATASET_DICT_MARKER).is_file():
        return True
    return all((path / name).is_file() for name in _DATASET_MARKERS)


def resolve_sources(path: str | os.PathLike, fmt: str = "auto", key: str = "data.path") -> list[Source]:
    """The inputs under ``path`` with their formats; ``key`` names the config entry in messages."""
    fmt = check_format(fmt)
    if fmt == "synthetic":
        raise DataError(
            f"{key} is set but data.format is 'synthetic' (the generated task): set data.format to auto "
            f"(or text/jsonl/parquet/arrow) to read it, or remove {key}"
        )
    root = Path(path).expanduser()
    if not root.exists() and _GLOB_CHARS.intersection(str(root)):
        matches = sorted(glob.glob(str(root), recursive=True))
        if not matches:
            raise DataError(f"{key}: the pattern {str(root)!r} matches no files. Check the path in {key}.")
        return [source for match in matches for source in _resolve_existing(Path(match), fmt, key)]
    if not root.exists():
        raise DataError(f"{key}: {root} does not exist (resolved to {root.absolute()}). Check the path in {key}.")
    return _resolve_existing(root, fmt, key)


def _resolve_existing(root: Path, fmt: str, key: str) -> list[Source]:
    """The inputs of one existing file or directory."""
    if root.is_file():
        return [Source(root, _file_format(root, fmt))]
    if is_saved_dataset(root):
        if fmt not in ("auto", "arrow"):
            raise DataError(f"{root} is a directory written by save_to_disk; set data.format to 'arrow' or 'auto'.")
        return [Source(root, "arrow")]
    sources, skipped = _walk(root, fmt)
    if not sources:
        seen = ", ".join(skipped[:8]) + (", ..." if len(skipped) > 8 else "") if skipped else "nothing"
        known = ", ".join(EXTENSIONS)
        raise DataError(
            f"{key}: directory {root} holds no data files (looked for {known} files and save_to_disk "
            f"directories; found {seen}). Point {key} at the data, or set data.format to read other files."
        )
    return sources


def _walk(root: Path, fmt: str) -> tuple[list[Source], list[str]]:
    """Data sources below ``root`` in sorted order, and the names of files skipped."""
    sources: list[Source] = []
    skipped: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue  # .git, .cache, editor files: never data
        if entry.is_dir():
            if is_saved_dataset(entry):
                # Its .arrow/.json files are not text or JSONL data: take it whole or not at all.
                if fmt in ("auto", "arrow"):
                    sources.append(Source(entry, "arrow"))
                else:
                    skipped.append(entry.name + "/")
            else:
                more, more_skipped = _walk(entry, fmt)
                sources += more
                skipped += more_skipped
        elif fmt == "arrow":
            skipped.append(entry.name)  # loose files cannot be a save_to_disk dataset
        elif fmt == "auto":
            found = EXTENSIONS.get(entry.suffix.lower())
            if found:
                sources.append(Source(entry, found))
            else:
                skipped.append(entry.name)
        else:
            sources.append(Source(entry, fmt))
    return sources, skipped


def _file_format(path: Path, fmt: str) -> str:
    """The format to read one file in: ``fmt``, or the one its extension names."""
    if fmt == "arrow":
        raise DataError(
            f"{path}: data.format 'arrow' reads a directory written by datasets' save_to_disk, not a file. "
            "Point data.path at that directory."
        )
    if fmt != "auto":
        return fmt
    found = EXTENSIONS.get(path.suffix.lower())
    if found is None:
        hint = " (for a save_to_disk dataset give its directory)" if path.suffix.lower() == ".arrow" else ""
        raise DataError(
            f"{path}: cannot tell the format from the extension {path.suffix or '(none)'!r}{hint}. "
            f"Known extensions: {', '.join(EXTENSIONS)}. Rename the file or set data.format to one of "
            f"{', '.join(FILE_FORMATS)}."
        )
    return found


def fingerprint(sources: list[Source]) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime in ns) of every input file: what the cache key hashes,
    so editing, replacing or adding a file invalidates the cached tokens."""
    rows = []
    for source in sources:
        for file in source.files():
            stat = file.stat()
            rows.append((str(file.absolute()), stat.st_size, stat.st_mtime_ns))
    return rows
