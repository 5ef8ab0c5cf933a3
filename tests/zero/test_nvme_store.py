"""NvmeStore: round trips, async ordering, bounded memory, clear errors, cleanup."""

from __future__ import annotations

import gc
import os
import socket
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from zerotrain.config import ConfigError
from zerotrain.zero import nvme_store
from zerotrain.zero.nvme_store import NvmeStore

@pytest.fixture
def store(tmp_path):
    s = NvmeStore(tmp_path, rank=0)
    yield s
    s._errors.clear()  # a test may leave a deliberate error behind
    s.close()


def _samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(1000, 37, generator=g),
        "bf16": torch.randn(513, generator=g).to(torch.bfloat16),
        "bf16-scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "fp16": torch.randn(7, 3, generator=g).half(),
        "int64": torch.randint(-2**40, 2**40, (301,), generator=g),
        "int8": torch.randint(-128, 127, (4097,), dtype=torch.int8, generator=g),
        "bool": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 5),
        "big": torch.randn(3 << 20, generator=g),  # 12 MB
    }


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("chunk", [64 << 20, 4093])  # default chunking and many odd-sized chunks
def test_round_trip_all_dtypes(store, monkeypatch, chunk):
    monkeypatch.setattr(nvme_store, "_CHUNK_BYTES", chunk)
    tensors = _samples()
    expected = {k: t.clone() for k, t in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for key, t in tensors.items():
        store.swap_out(key, t)
    assert store.resident_bytes() <= total
    store.wait_all()
    assert store.resident_bytes() == 0
    for key, t in tensors.items():
        assert _storage_bytes(t) == 0, key
        assert os.path.getsize(store._entries[key].path) == expected[key].numel() * expected[key].element_size()
    for i, (key, t) in enumerate(tensors.items()):
        store.swap_in(key, t)
        assert _storage_bytes(t) == expected[key].numel() * expected[key].element_size()
        assert t.dtype == expected[key].dtype and t.shape == expected[key].shape
        assert torch.equal(t, expected[key]), key
        assert store.resident_bytes() == sum(e.numel() * e.element_size() for e in list(expected.values())[: i + 1])
    assert store.resident_bytes() == total


def test_parameter_keeps_identity_and_autograd(store):
    p = torch.nn.Parameter(torch.randn(64, 64))
    ref = p.detach().clone()
    opt_state = {p: "state"}  # optimizers key state by tensor identity
    store.swap_out("p", p)
    store.wait("p")
    assert _storage_bytes(p) == 0
    store.swap_in("p", p)
    assert p in opt_state and torch.equal(p.detach(), ref)
    (p * 2).sum().backward()
    assert torch.equal(p.grad, torch.full_like(ref, 2.0))


def test_async_swap_in_then_wait(store):
    ts = {f"k{i}": torch.randn(200_000) for i in range(6)}
    ref = {k: t.clone() for k, t in ts.items()}
    for k, t in ts.items():
        store.swap_out(k, t)
    store.wait_all()
    for k, t in ts.items():
        store.swap_in(k, t, async_op=True)
    for k, t in ts.items():
        store.wait(k)
        assert torch.equal(t, ref[k])
    store.swap_in("k0", ts["k0"])  # already resident: a no-op
    assert torch.equal(ts["k0"], ref["k0"])


def _slow_writes(monkeypatch, delay: float = 0.3):
    real = nvme_store._write_chunk

    def slow(path, view, offset):
        time.sleep(delay)
        real(path, view, offset)

    monkeypatch.setattr(nvme_store, "_write_chunk", slow)


def test_swap_in_waits_for_in_flight_write(store, monkeypatch):
    _slow_writes(monkeypatch)
    t = torch.randn(100_000)
    ref = t.clone()
    store.swap_out("a", t)
    fresh = torch.empty_like(t)
    fresh.untyped_storage().resize_(0)
    store.swap_in("a", fresh)  # a different tensor: must read the file, after the write ended
    assert torch.equal(fresh, ref)
    assert _storage_bytes(t) == 0  # the written-out tensor was released

    u = torch.randn(5000)
    ref_u = u.clone()
    store.swap_out("b", u)
    store.swap_in("b", u)  # the same tensor: write completes, its bytes stay
    assert torch.equal(u, ref_u)
    store.swap_out("b", u)  # and it can be parked again
    store.wait("b")
    assert _storage_bytes(u) == 0
    store.swap_in("b", u)
    assert torch.equal(u, ref_u)


def test_swap_out_waits_for_in_flight_read(store, monkeypatch):
    t = torch.randn(1 << 20)
    ref = t.clone()
    store.swap_out("r", t)
    store.wait("r")
    real = nvme_store._read_chunk
    monkeypatch.setattr(nvme_store, "_read_chunk", lambda *a: (time.sleep(0.3), real(*a)))
    store.swap_in("r", t, async_op=True)
    store.swap_out("r", t)  # must not write half-read bytes
    store.wait("r")
    store.swap_in("r", t)
    assert torch.equal(t, ref)


def test_max_in_flight_blocks(tmp_path, monkeypatch):
    gate = threading.Event()
    real = nvme_store._write_chunk
    monkeypatch.setattr(nvme_store, "_write_chunk", lambda *a: (gate.wait(10), real(*a)))
    s = NvmeStore(tmp_path, rank=0, max_in_flight=3, threads=2)
    ts = [torch.full((1000,), float(i)) for i in range(4)]
    for i in range(3):
        s.swap_out(f"t{i}", ts[i])  # returns at once: 3 in flight
    done = threading.Event()
    worker = threading.Thread(target=lambda: (s.swap_out("t3", ts[3]), done.set()))
    worker.start()
    assert not done.wait(0.3), "a 4th operation must block while 3 are in flight"
    gate.set()
    assert done.wait(10)
    worker.join()
    s.wait_all()
    for i, t in enumerate(ts):
        s.swap_in(f"t{i}", t)
        assert torch.equal(t, torch.full((1000,), float(i)))
    s.close()


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _peak_growth_mb(store: NvmeStore, count: int, mb: int, tag: str) -> tuple[float, list[torch.Tensor]]:
    """Park `count` tensors of `mb` MB one after another; peak RSS growth in MB."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kb("VmRSS")
    kept = []
    for i in range(count):
        t = torch.full((mb << 18,), float(i))
        store.swap_out(f"{tag}{i}", t)
        kept.append(t)  # identity kept; storage released by the store
    store.wait_all()
    return (_status_kb("VmHWM") - base) / 1024, kept


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_memory_stays_bounded(tmp_path):
    bound_mb = 64
    with NvmeStore(tmp_path, rank=0, max_in_flight=4) as s:
        growth_small, kept_small = _peak_growth_mb(s, 64, 4, "s")  # 256 MB parked
        growth_large, kept_large = _peak_growth_mb(s, 128, 4, "l")  # 512 MB parked
        print(f"peak RSS growth: {growth_small:.1f} MB for 256 MB parked, {growth_large:.1f} MB for 512 MB parked")
        assert growth_small < bound_mb and growth_large < bound_mb
        assert s.resident_bytes() == 0
        assert all(_storage_bytes(t) == 0 for t in kept_small + kept_large)
        for i in (0, 63):
            s.swap_in(f"s{i}", kept_small[i])
            assert torch.equal(kept_small[i], torch.full((1 << 20,), float(i)))
        s.swap_in("l127", kept_large[127])
        assert torch.equal(kept_large[127], torch.full((1 << 20,), 127.0))


# ------------------------------------------------------------------ errors
def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist: create it") as e:
        NvmeStore(missing, rank=0)
    assert str(missing) in str(e.value)


def test_file_instead_of_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory") as e:
        NvmeStore(f, rank=0)
    assert str(f) in str(e.value)


def _store_error_as_nobody(path: str) -> str:
    """Try NvmeStore(path) in a forked child running as user nobody; its ConfigError message."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no exec, so nothing has to be readable by nobody but `path` itself
        message = "NO ERROR"
        try:
            os.setgid(65534)
            os.setuid(65534)
            NvmeStore(path, rank=0)
        except ConfigError as exc:
            message = f"CONFIGERROR {exc}"
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            message = f"CHILD FAILED {exc!r}"
        finally:
            os.write(write_fd, message.encode())
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_unwritable_dir(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="is not writable") as e:
                NvmeStore(ro, rank=0)
            assert str(ro) in str(e.value)
        finally:
            ro.chmod(0o700)
        return
    # root ignores permission bits: check as an unprivileged user in a forked child. The
    # directory sits directly in /tmp because pytest's tmp_path (0o700) is not traversable for it.
    ro = tempfile.mkdtemp(prefix="zerotrain-ro-")
    os.chmod(ro, 0o555)
    try:
        out = _store_error_as_nobody(ro)
        if out.startswith("CHILD FAILED PermissionError"):
            pytest.skip(f"root without the right to switch user, and chmod cannot block root: {out}")
        assert out.startswith("CONFIGERROR") and "is not writable" in out and ro in out, out
        assert os.listdir(ro) == []
    finally:
        shutil.rmtree(ro)


def test_not_enough_space(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match=r"GB free but .* GB are needed") as e:
        NvmeStore(tmp_path, rank=0, needed_bytes=free + 10**15)
    assert str(tmp_path) in str(e.value)
    assert os.listdir(tmp_path) == []  # no directory left behind
    NvmeStore(tmp_path, rank=0, needed_bytes=1 << 20).close()  # enough space: fine


def test_swap_out_rejects_non_owning(store):
    base = torch.randn(10, 10)
    for bad in (base[2:], base.t(), base[:, 0], torch.from_numpy(base.numpy().copy()).view(-1)[:5]):
        with pytest.raises(ValueError, match="owns its whole storage"):
            store.swap_out("bad", bad)
    assert _storage_bytes(base) == 400


def test_write_error_surfaces_and_keeps_data(store):
    t = torch.randn(10_000)
    ref = t.clone()
    shutil.rmtree(store.directory)  # the directory vanishes behind the store's back
    store.swap_out("w", t)
    with pytest.raises(RuntimeError, match="swap out of 'w' failed on file") as e:
        store.wait("w")
    assert store._entries["w"].path in str(e.value)
    assert torch.equal(t, ref) and store.resident_bytes() == t.nbytes  # data not lost
    store.swap_out("x", torch.randn(10))
    with pytest.raises(RuntimeError, match="failed on file"):
        store.wait_all()  # surfaces without naming the key
    os.makedirs(store.directory)
    store.swap_out("w", t)  # retry once the disk is back
    store.wait("w")
    store.swap_in("w", t)
    assert torch.equal(t, ref)


def test_read_error_surfaces(store):
    a, b = torch.randn(1000), torch.randn(1000)
    for k, t in (("a", a), ("b", b)):
        store.swap_out(k, t)
    store.wait_all()
    for k in ("a", "b"):
        os.remove(store._entries[k].path)
    with pytest.raises(RuntimeError, match="swap in of 'a' failed on file .*a-") as e:
        store.swap_in("a", a)
    assert store._entries["a"].path in str(e.value)
    assert _storage_bytes(a) == 0
    store.swap_in("b", b, async_op=True)
    with pytest.raises(RuntimeError, match="swap in of 'b' failed"):
        store.wait("b")
    with pytest.raises(KeyError):
        store.swap_in("never", a)


def test_keys_are_sanitized(store):
    keys = ["a/b", "a_b", "../../etc/passwd", "x" * 500, "ünï cødé"]
    ts = {k: torch.full((3,), float(i)) for i, k in enumerate(keys)}
    for k, t in ts.items():
        store.swap_out(k, t)
    store.wait_all()
    files = os.listdir(store.directory)
    assert len(files) == len(keys) and all(len(f) < 120 for f in files)
    for i, (k, t) in enumerate(ts.items()):
        store.swap_in(k, t)
        assert torch.equal(t, torch.full((3,), float(i)))


def test_close_removes_directory(tmp_path):
    s = NvmeStore(tmp_path, rank=3)
    name = os.path.basename(s.directory)
    assert name.startswith(f"zerotrain-rank3@{socket.gethostname()}@{os.getpid()}-")
    t = torch.randn(1000)
    s.swap_out("t", t)
    s.close()  # waits for the write first
    assert not os.path.exists(s.directory) and os.listdir(tmp_path) == []
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.swap_in("t", t)
    # Dropping a store without close() also removes its files.
    s2 = NvmeStore(tmp_path, rank=0)
    s2.swap_out("t", torch.randn(10))
    d = s2.directory
    del s2
    gc.collect()
    assert not os.path.exists(d)


def test_a_store_removes_the_folders_of_dead_processes_on_this_machine_only(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    host = socket.gethostname()
    orphan = tmp_path / f"zerotrain-rank0@{host}@{dead.pid}-abc123"
    elsewhere = tmp_path / f"zerotrain-rank0@other-node@{dead.pid}-abc123"  # a shared path: not ours to judge
    alive = tmp_path / f"zerotrain-rank1@{host}@{os.getpid()}-abc123"
    for folder in (orphan, elsewhere, alive):
        folder.mkdir()
        (folder / "swap").write_bytes(b"x" * 100)
    store = NvmeStore(tmp_path, rank=0)
    assert not orphan.exists() and elsewhere.exists() and alive.exists()
    store.close()
