"""Files and folders published so that a crash, even a power loss, leaves the old version or the whole new one.

A file is written under a temporary name in its own folder, flushed to disk (fsync), renamed over
the target (`os.replace`, atomic on POSIX), and then the folder is fsynced, so the rename itself is
on disk too. A folder (a checkpoint tag, a staged export) is published by one rename, followed by
the same fsync of the folder that holds it. Every writer in zerotrain that replaces a file others
may read goes through here.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path_for(path: Path) -> Path:
    """The temporary name an atomic write of `path` uses: `.NAME.tmp-PID-RANDOM`, beside it (the same
    file system, so the final rename is atomic), unique per call so concurrent writers never share one."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temp_of(name: str, target: str) -> bool:
    """Whether the file called `name` is what an interrupted atomic write of `target` left behind
    (also an earlier version's fixed `.TARGET.tmp`)."""
    return re.fullmatch(rf"\.{re.escape(target)}\.tmp(-.*)?", name) is not None


def fsync_path(path: str | os.PathLike) -> None:
    """Flushes a file's contents, or a folder's entries (renames and new names in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yields a temporary path beside `path` for the caller to write (with any library); when the block
    ends without error the file gets `mode` (if given), is fsynced and renamed over `path`, and the
    folder is fsynced. On an error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    temp = temp_path_for(path)
    try:
        yield temp
        if mode is not None:
            os.chmod(temp, mode)
        fsync_path(temp)
        os.replace(temp, path)
        fsync_path(path.parent)
    finally:
        temp.unlink(missing_ok=True)  # gone already after the rename; a failed write's leftover otherwise


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """Replaces `path` with `text` (UTF-8) durably: readers see the old file or the whole new one."""
    with atomic_file(path, mode) as temp:
        temp.write_text(text, encoding="utf-8")


def rename_durably(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Renames `source` to `target` (a whole folder is published this way) and fsyncs the folder that
    holds `target`, so the rename survives a power loss. Fails as `os.rename` does (e.g. a non-empty
    folder at `target`). The caller fsyncs what `source` holds first."""
    os.rename(source, target)
    fsync_path(Path(target).parent)
