"""The one durable write: a file is replaced whole or not at all, fsynced, and so is the folder's rename;
every writer that replaces a file goes through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zerotrain.system.durable_files import atomic_file, atomic_write_text, is_temp_of, rename_durably


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """What was fsynced, in order: 'file NAME' or 'folder NAME'."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("names an fsynced descriptor through /proc (Linux)")
    seen: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        seen.append(f"{'folder' if path.is_dir() else 'file'} {path.name}")
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def test_a_write_fsyncs_the_file_then_renames_it_then_fsyncs_the_folder(tmp_path, fsynced):
    target = tmp_path / "latest"
    target.write_text("old")
    atomic_write_text(target, "new", mode=0o640)
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) == oct(0o640)
    assert len(fsynced) == 2 and fsynced[0].startswith("file .latest.tmp-") and fsynced[1] == f"folder {tmp_path.name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"):
        with atomic_file(target) as temp:
            temp.write_bytes(b"half")
            raise OSError("disk full")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]


def test_a_folder_rename_fsyncs_the_folder_holding_it(tmp_path, fsynced):
    staged = tmp_path / ".tag.tmp"
    staged.mkdir()
    rename_durably(staged, tmp_path / "tag")
    assert (tmp_path / "tag").is_dir() and fsynced == [f"folder {tmp_path.name}"]


def test_leftover_temporaries_are_recognised_by_their_target():
    assert is_temp_of(".latest.tmp-123-abcdef01", "latest") and is_temp_of(".latest.tmp", "latest")
    assert not is_temp_of(".latest.tmpx", "latest") and not is_temp_of(".tmp-latest", "latest")
    assert not is_temp_of(".other.tmp-1-2", "latest")


@pytest.mark.parametrize("write", ["pid", "prediction", "bench_status", "latest", "zero_to_fp32"])
def test_every_file_writer_goes_through_the_durable_write(tmp_path, fsynced, write):
    # Before: these replaced files without an fsync of the file or of its folder (latest alone did both).
    if write == "pid":
        from zerotrain.train.run_control import write_pid
        write_pid(tmp_path, 42)
    elif write == "prediction":
        from zerotrain.train.step_prediction import write_prediction
        write_prediction(tmp_path, {"step_s": 1.0, "world_size": 2})
    elif write == "bench_status":
        from zerotrain.bench.run_dir import JobStatus
        JobStatus(job="job", nodes=["localhost"], state="running").write(tmp_path)
    elif write == "latest":
        from zerotrain.checkpoint.saver import publish_latest
        publish_latest(tmp_path, "step1")
    else:
        from zerotrain.checkpoint.zero_to_fp32_script import write_zero_to_fp32_script
        write_zero_to_fp32_script(tmp_path)
    assert len(fsynced) >= 2, f"neither the file nor its folder was fsynced: {fsynced}"
    assert fsynced[-1] == f"folder {tmp_path.name}" and fsynced[-2].startswith("file ."), fsynced
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
