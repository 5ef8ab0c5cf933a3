"""NVMe swap store: park CPU tensors in files and bring them back, asynchronously.

ZeRO-Infinity keeps fp32 master shards, optimizer state and (stage 3) parameter shards
on a local NVMe disk. A swapped-out tensor keeps its Python identity (optimizers key
their state by tensor); only its *storage* is released (``resize_(0)``), later re-grown
and refilled from its file. I/O goes straight between the tensor's memory and the file
(no staging buffers, no pickling), so pending operations hold at most ``max_in_flight``
tensors. Threading: the training thread owns all bookkeeping and alone touches storages;
workers only run ``os.pwrite``/``os.preadv`` (GIL released) on memoryviews given to them.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import hashlib
import os
import re
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch

from zerotrain.comm.fault_points import fault_point
from zerotrain.config import ConfigError

__all__ = ["NvmeStore"]

# Large tensors are split so several workers can keep the disk's queue busy on one tensor.
_CHUNK_BYTES = 64 << 20
# Freed memory must go back to the OS or RSS grows with the amount parked: glibc serves
# blocks >= 32 MiB (its top dynamic mmap threshold) with mmap, unmapped on free, but smaller
# ones may sit in the heap, pinned there by small live objects. malloc_trim releases those
# pages; it costs ~1 ms, so it runs once per _TRIM_EVERY bytes freed, not per tensor.
_MMAP_MIN, _TRIM_EVERY = 32 << 20, 16 << 20
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # None off glibc (musl, macOS)


def _chunk_io(path: str, view: memoryview, offset: int, write: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY, 0o600)
    try:
        done = 0
        while done < len(view):  # both calls may move fewer bytes than asked (signals, 2 GiB cap)
            n = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
            if write:
                fault_point("nvme_write")  # part of a swap file written, the rest not
            if n == 0:
                raise OSError(f"file ends at byte {offset + done}, expected {offset + len(view)} bytes")
            done += n
    finally:
        os.close(fd)


_write_chunk, _read_chunk = partial(_chunk_io, write=True), partial(_chunk_io, write=False)


def _cleanup(pool: cf.ThreadPoolExecutor, directory: str, pid: int) -> None:  # no ref to the store: finalize
    if os.getpid() != pid:
        return  # a forked child (e.g. a DataLoader worker) exiting must not delete our files
    pool.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


_STORE_DIR = re.compile(r"zerotrain-rank\d+@([^@/]+)@(\d+)-")


def _remove_orphans(path: str) -> None:
    """Removes the store folders of processes that died without cleaning up (SIGKILL, OOM killer):
    their swap files would otherwise fill the NVMe drive run after run. A folder whose process
    still lives (ours, a concurrent job's) is left alone."""
    for name in os.listdir(path):
        match = _STORE_DIR.match(name)
        # Only this machine's: an nvme_path another node shares holds folders of pids that live there.
        if match and match.group(1) == socket.gethostname() and not os.path.exists(f"/proc/{match.group(2)}"):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


_Op = collections.namedtuple("_Op", "kind tensor futures")  # kind: "read"/"write"; futures: one per chunk


@dataclass
class _Entry:
    path: str
    nbytes: int
    in_memory: bool = True
    op: _Op | None = field(default=None, repr=False)


class NvmeStore:
    """Tensors parked in files under nvme_path; swapped in and out asynchronously by a thread pool."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, *, needed_bytes: int = 0,
                 max_in_flight: int = 4, threads: int = 2) -> None:
        """Validate ``nvme_path`` and create this store's private directory in it.

        ``needed_bytes``: how much this store will park; checked against free space.
        ``max_in_flight``: at most this many swap operations pending; more block.
        Raises ``ConfigError`` naming the path if it is unusable.
        """
        if max_in_flight < 1 or threads < 1:
            raise ValueError(f"max_in_flight ({max_in_flight}) and threads ({threads}) must be >= 1")
        path = os.path.abspath(os.fspath(nvme_path))
        if not os.path.exists(path):
            raise ConfigError(f"nvme_path {path!r} does not exist: create it or point nvme_path at a local NVMe mount")
        if not os.path.isdir(path):
            raise ConfigError(f"nvme_path {path!r} is not a directory: point nvme_path at a directory on a local NVMe mount")
        _remove_orphans(path)
        try:  # Creating our directory is the writability test (os.access lies for root and some mounts).
            self.directory = tempfile.mkdtemp(prefix=f"zerotrain-rank{rank}@{socket.gethostname()}@{os.getpid()}-", dir=path)
        except OSError as exc:
            raise ConfigError(f"nvme_path {path!r} is not writable ({exc.strerror}): "
                              "fix its permissions or point nvme_path at a writable local NVMe mount") from exc
        free = shutil.disk_usage(path).free
        if free < needed_bytes:
            os.rmdir(self.directory)
            raise ConfigError(f"nvme_path {path!r} has {free / 1e9:.2f} GB free but {needed_bytes / 1e9:.2f} GB are needed: "
                              "free space there or point nvme_path at a larger local NVMe mount")
        self.nvme_path = path
        self.max_in_flight = max_in_flight
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"zerotrain-nvme{rank}")
        self._entries: dict[str, _Entry] = {}
        self._pending: collections.deque[str] = collections.deque()  # keys with an op, oldest first
        self._errors: list[tuple[str, BaseException]] = []  # (message, cause), reported once
        self._closed = False
        self._untrimmed = 0  # heap bytes freed since the last malloc_trim (see _MMAP_MIN)
        # Files must not outlive the process even if close() is never called: finalize runs on
        # garbage collection or, at the latest, at interpreter exit (its atexit flag is on by default).
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, self.directory, os.getpid())

    def swap_out(self, key: str, t: torch.Tensor) -> None:
        """Start writing ``t``'s bytes to ``key``'s file; its storage is released once the write ends.

        ``t`` must be a contiguous CPU tensor owning its whole storage (not a view). The release
        happens at the next store call that finds the write done (at the latest ``wait(key)``).
        """
        self._settle()
        entry = self._entries.get(key)
        if entry is not None and entry.op is not None:
            self._finish(key)  # a read still filling t must end before we write t out
            self._raise_errors()
        storage = t.untyped_storage()
        if entry is not None and not entry.in_memory and storage.nbytes() == 0:
            return  # already parked: nothing to do
        _check_owning(key, t)
        if entry is None:
            entry = self._entries[key] = _Entry(os.path.join(self.directory, _file_name(key)), 0)
        entry.nbytes, entry.in_memory = storage.nbytes(), True
        self._submit(key, "write", t)

    def swap_in(self, key: str, t: torch.Tensor, async_op: bool = False) -> None:
        """Restore ``t``'s storage (``nbytes`` of it) and read ``key``'s file into it.

        Waits first for a pending write of ``key``; if ``t`` is the very tensor being
        written, its bytes are still in memory and are simply kept. With ``async_op``
        the read is launched and ``wait(key)`` completes it; ``t`` must not be used
        before. A no-op if ``key`` is already in memory.
        """
        self._settle()
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"swap_in({key!r}): this key was never swapped out")
        if entry.op is not None:
            if entry.op.kind == "read":
                return None if async_op else self.wait(key)
            same = entry.op.tensor.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            self._finish(key, release=not same)  # read-after-write: the file must be complete
            self._raise_errors()
        if entry.in_memory:
            if t.untyped_storage().nbytes() != entry.nbytes:
                raise RuntimeError(f"swap_in({key!r}): the key is in memory (not swapped out), but this tensor has no data; "
                                   "pass the tensor that was swapped out")
            return
        if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() or t.nbytes != entry.nbytes:
            raise ValueError(f"swap_in({key!r}) needs a contiguous CPU tensor at offset 0 of {entry.nbytes} bytes "
                             f"(as swapped out); got {t.device}, contiguous={t.is_contiguous()}, {t.nbytes} bytes")
        if t.untyped_storage().nbytes() != entry.nbytes:
            t.untyped_storage().resize_(entry.nbytes)
        entry.in_memory = True
        self._submit(key, "read", t)
        if not async_op:
            self.wait(key)

    def allocate(self, key: str, t: torch.Tensor) -> None:
        """Give ``t`` back storage for all its bytes *without* reading ``key``'s file.

        For a caller about to overwrite every element (a new gradient, an updated
        parameter). ``key`` need not exist yet; a pending write of ``t`` ends first
        and its memory is reused. Contents are undefined until the caller writes them.
        """
        self._settle()
        entry = self._entries.get(key)
        if entry is not None and entry.op is not None:
            self._finish(key, release=False)  # t may not change while a write still reads it
            self._raise_errors()
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() or t._is_view():
            raise ValueError(f"allocate({key!r}) needs a contiguous CPU tensor owning its storage; "
                             f"got {t.device}, contiguous={t.is_contiguous()}, offset {t.storage_offset()}")
        if entry is None:
            entry = self._entries[key] = _Entry(os.path.join(self.directory, _file_name(key)), nbytes)
        if t.untyped_storage().nbytes() != nbytes:
            t.untyped_storage().resize_(nbytes)
        entry.nbytes, entry.in_memory = nbytes, True

    def discard(self, key: str, t: torch.Tensor) -> None:
        """Release ``t``'s storage *without* writing it: the file already holds these bytes
        (``t`` is unchanged since it was read or written), or they are not needed again.

        A pending operation on ``key`` ends first. The file keeps what it last held.
        """
        self._settle()
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"discard({key!r}): this key was never swapped out or allocated")
        if entry.op is not None:
            self._finish(key)
            self._raise_errors()
        storage = t.untyped_storage()
        if storage.nbytes():
            self._untrimmed += storage.nbytes() if storage.nbytes() < _MMAP_MIN else 0
            storage.resize_(0)
            if self._untrimmed >= _TRIM_EVERY:
                self._trim()
        entry.in_memory = False

    def wait(self, key: str) -> None:
        """Complete ``key``'s pending operation; raise any recorded I/O error as RuntimeError."""
        self._check_open()
        if key not in self._entries:
            raise KeyError(f"wait({key!r}): this key was never swapped out")
        if self._entries[key].op is not None:
            self._finish(key)
        self._reap()
        self._raise_errors()

    def wait_all(self) -> None:
        """Complete every pending operation; raise any recorded I/O error as RuntimeError."""
        self._check_open()
        self._drain()
        self._raise_errors()

    def resident_bytes(self) -> int:
        """Bytes of this store's tensors currently held in memory (incl. ones being written out)."""
        if not self._closed:
            self._reap()
        return sum(e.nbytes for e in self._entries.values() if e.in_memory)

    def close(self) -> None:
        """Finish pending I/O, stop the workers and delete this store's directory.

        Tensors still swapped out lose their data. Raises the first I/O error left
        unreported, after cleaning up.
        """
        if self._closed:
            return
        self._drain()
        self._closed = True
        self._finalizer()
        self._raise_errors()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeStore at {self.directory} is closed")

    def _settle(self) -> None:
        self._check_open()
        self._reap()
        self._raise_errors()  # errors of earlier async ops surface before new work starts

    def _submit(self, key: str, kind: str, t: torch.Tensor) -> None:
        while len(self._pending) >= self.max_in_flight:  # back-pressure bounds memory pinned by pending ops
            self._finish(self._pending[0])
        entry = self._entries[key]
        futures = []
        if entry.nbytes:
            # Bytes of the whole storage, any dtype (bf16 too). Not via .numpy(): exporting to numpy
            # marks the storage non-resizable for good, which would break the next resize_(0).
            # op.tensor keeps the storage alive while workers use this raw view; once the op
            # ends, no worker holds it any more (the pool drops finished work items).
            array = (ctypes.c_ubyte * entry.nbytes).from_address(t.untyped_storage().data_ptr())
            view = memoryview(array).cast("B")
            fn = _write_chunk if kind == "write" else _read_chunk
            for off in range(0, entry.nbytes, _CHUNK_BYTES):
                futures.append(self._pool.submit(fn, entry.path, view[off:off + _CHUNK_BYTES], off))
        elif kind == "write":
            futures.append(self._pool.submit(_write_chunk, entry.path, memoryview(b""), 0))  # create the file
        entry.op = _Op(kind, t, futures)
        self._pending.append(key)

    def _drain(self) -> None:
        while self._pending:
            self._finish(self._pending[0])
        self._trim()

    def _reap(self) -> None:
        """Finish, without blocking, every pending op whose I/O already ended."""
        for key in [k for k in self._pending if all(f.done() for f in self._entries[k].op.futures)]:
            self._finish(key)

    def _finish(self, key: str, release: bool = True) -> None:
        """Wait for ``key``'s op, then update state on this thread; errors are recorded, not raised."""
        entry = self._entries[key]
        op = entry.op
        cf.wait(op.futures)
        entry.op = None
        self._pending.remove(key)
        exc = next((f.exception() for f in op.futures if f.exception() is not None), None)
        if exc is not None:
            direction = "out" if op.kind == "write" else "in"
            self._errors.append((f"NVMe swap {direction} of {key!r} failed on file {entry.path}: {exc}", exc))
        if op.kind == "write":
            if exc is None and release:
                op.tensor.untyped_storage().resize_(0)
                entry.in_memory = False
                self._untrimmed += entry.nbytes if entry.nbytes < _MMAP_MIN else 0
                if self._untrimmed >= _TRIM_EVERY:
                    self._trim()
            # on failure the tensor keeps its data: nothing is lost
        elif exc is not None:
            op.tensor.untyped_storage().resize_(0)  # partial garbage: back to "swapped out"
            entry.in_memory = False

    def _trim(self) -> None:
        if _malloc_trim is not None and self._untrimmed:
            _malloc_trim(0)
        self._untrimmed = 0

    def _raise_errors(self) -> None:
        if self._errors:
            (message, cause), more = self._errors[0], len(self._errors) - 1
            self._errors.clear()
            raise RuntimeError(message + (f" (and {more} more NVMe I/O error(s))" if more else "")) from cause


def _check_owning(key: str, t: torch.Tensor) -> None:
    storage, covered = t.untyped_storage(), t.numel() * t.element_size()
    problem = (f"it is on {t.device}" if t.device.type != "cpu"
               else "it is a view or not contiguous" if t._is_view() or t.storage_offset() or not t.is_contiguous()
               else f"its storage has {storage.nbytes()} bytes, the tensor covers {covered}" if storage.nbytes() != covered
               else "its storage is not resizable (e.g. shared with numpy)" if not storage.resizable() else None)
    if problem:
        raise ValueError(f"swap_out({key!r}) needs a contiguous CPU tensor that owns its whole storage, but {problem}; "
                         "pass a standalone tensor (e.g. t.clone())")


def _file_name(key: str) -> str:
    # Readable prefix plus a hash: distinct keys never collide after sanitizing.
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80].lstrip(".")
    return f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.swp"
