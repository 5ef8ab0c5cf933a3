"""A `zerotrain consolidate` killed at any moment leaves no output that looks complete, and a rerun writes it whole.

The command is killed with SIGKILL at the `consolidate` fault point (ZEROTRAIN_FAULT=consolidate:VICTIM,
zerotrain/comm/fault_points.py: the first output file written, the others not), run as users run it: the
installed console script, from a folder of its own. Then: no OUTPUT folder (a new one) or the earlier
output untouched (an existing one), the checkpoint read untouched, and the same command run again exits 0,
leaves no staging folder behind and writes weights equal, bit for bit, to an uninterrupted consolidate's.
docs/checkpoints.md ("Crash safety") says what a killed consolidate leaves.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint.checkpoint_fixtures import load_safetensors, small_checkpoint
from safetensors.torch import load_file

from zerotrain.checkpoint import consolidate

SHARDS = ["--max-shard-size", "200B"]  # small_checkpoint's ~1 KB model in several files: a kill between them


def digests(root: Path) -> dict[str, str]:
    """Every file under `root` by its path: its SHA-256."""
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_bitwise_equal(got_dir: Path, want_dir: Path) -> None:
    """The same files: weight files with the same tensors (names, dtypes, shapes, bits), the rest byte for byte."""
    names = sorted(p.name for p in want_dir.iterdir())
    assert sorted(p.name for p in got_dir.iterdir()) == names
    for name in names:
        if not name.endswith(".safetensors"):
            assert (got_dir / name).read_bytes() == (want_dir / name).read_bytes(), name
            continue
        got, want = load_file(got_dir / name), load_file(want_dir / name)
        assert sorted(got) == sorted(want), name
        for key, tensor in want.items():
            assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, (name, key)
            bits = (t.reshape(-1).view(torch.uint8) for t in (got[key], tensor))
            assert torch.equal(*bits), (name, key)


@pytest.fixture
def killed_setup(tmp_path, monkeypatch):
    """(a small checkpoint in tmp_path/ckpt, tmp_path/reference: its uninterrupted consolidate in 200-byte shards)."""
    monkeypatch.delenv("RANK", raising=False)  # not a rank of some job: the process is rank 0
    ckpt, _ = small_checkpoint(tmp_path)
    reference = tmp_path / "reference"
    consolidate(ckpt, reference, max_shard_size="200B")  # the uninterrupted consolidate
    assert len(list(reference.glob("model-*-of-*.safetensors"))) >= 3
    return ckpt, reference


def run_killed(zerotrain_cli, ckpt: Path, out: Path, victim: str) -> subprocess.CompletedProcess:
    run = zerotrain_cli("consolidate", ckpt, out, *SHARDS, env={"ZEROTRAIN_FAULT": f"consolidate:{victim}"})
    assert run.returncode in (-9, 137), f"not killed: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    return run


def test_a_consolidate_killed_after_its_first_file_leaves_no_output_and_a_rerun_writes_it_whole(
        tmp_path, zerotrain_cli, killed_setup):
    ckpt, reference = killed_setup
    before = digests(ckpt)
    out = tmp_path / "out"
    run_killed(zerotrain_cli, ckpt, out, "rank0")
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    staged = [sorted(p.name for p in s.iterdir()) for s in tmp_path.glob(".out.tmp-*")]
    assert len(staged) == 1 and len(staged[0]) == 1 and staged[0][0].startswith("model-00001-of-"), staged  # one file
    assert digests(ckpt) == before, "the checkpoint read was changed"

    rerun = zerotrain_cli("consolidate", ckpt, out, *SHARDS)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "wrote model to" in rerun.stdout
    assert not list(tmp_path.glob(".*.tmp-*")), "a staging folder was left beside the output"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert_bitwise_equal(out, reference)
    assert digests(ckpt) == before, "the checkpoint read was changed"


def test_a_consolidate_killed_over_an_earlier_output_leaves_that_output_whole(tmp_path, zerotrain_cli, killed_setup):
    ckpt, reference = killed_setup
    out = tmp_path / "out"
    consolidate(ckpt, out, dtype="bf16")  # an earlier output, in the other layout (one file) and dtype
    earlier = digests(out)
    run_killed(zerotrain_cli, ckpt, out, "all")
    assert {k: v for k, v in digests(out).items() if not k.startswith(".")} == earlier, "the earlier output changed"
    assert [p.name.startswith(".consolidate.tmp-") for p in out.iterdir() if p.name.startswith(".")] == [True]

    rerun = zerotrain_cli("consolidate", ckpt, out, *SHARDS)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert not list(tmp_path.glob(".*.tmp-*")) and not [p for p in out.iterdir() if p.name.startswith(".")]
    assert_bitwise_equal(out, reference)  # the earlier single file is gone: only the new shards and index


def test_leftovers_of_dead_runs_go_and_those_of_live_runs_or_other_machines_stay(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host = int(dead.stdout), socket.gethostname()
    (tmp_path / "out").mkdir()
    leftovers = {  # path: (a folder, kept)
        tmp_path / f".out.tmp-{host}-{dead_pid}": (True, False),  # a killed run's new folder
        tmp_path / "out" / f".consolidate.tmp-{host}-{dead_pid}": (True, False),  # a killed run's, over an existing one
        tmp_path / "out" / f".model.safetensors.tmp-{dead_pid}": (False, False),  # an earlier version's temporary file
        tmp_path / f".out.tmp-{host}-{os.getppid()}": (True, True),  # a live run's
        tmp_path / f".out.tmp-elsewhere-{dead_pid}": (True, True),  # another machine's, on a shared file system
        tmp_path / "out" / f".notes.tmp-{dead_pid}": (False, True),  # not consolidate's
    }
    for path, (folder, _) in leftovers.items():
        path.mkdir() if folder else path.write_text("x")
    consolidate(ckpt, tmp_path / "out")
    assert {path: path.exists() for path in leftovers} == {path: kept for path, (_, kept) in leftovers.items()}
    assert sorted(load_safetensors(list((tmp_path / "out").iterdir()))) == sorted(ref)
