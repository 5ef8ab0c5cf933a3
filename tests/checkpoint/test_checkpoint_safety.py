"""A checkpoint survives a killed save, refuses a lone caller, and names the file it cannot read."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import zerotrain
from conftest import run_on_ranks, start_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config
from zerotrain.checkpoint import CheckpointError, CheckpointReader
from zerotrain.checkpoint.coordination import TIMEOUT_ENV
from zerotrain.comm.fault_points import FAULT_ENV
from zerotrain.system.processes import process_state

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _engine(stage: int = 2, world: int = 2, seed: int = 0):
    model = make_model(seed=seed)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(stage, world, 1))
    return engine


def _step(engine, step: int) -> None:
    import torch.distributed as dist

    micro, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    ids = global_batch(step)[rank * micro :][:micro]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _save_twice(save_dir: str) -> None:
    """Saves global_step1, then global_step2 (the second arrival at each fault point, where the test's stops)."""
    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(save_dir)
    _step(engine, 1)
    engine.save_checkpoint(save_dir)


@pytest.mark.parametrize("phase", ["after_shards", "before_rename", "before_latest"])
def test_save_killed_midway_leaves_latest_pointing_at_a_whole_checkpoint(tmp_path, phase):
    save_dir = tmp_path / "ckpt"
    # Rank 0 freezes itself (SIGSTOP) at `phase` of the second save and stays there until killed.
    procs, _ = start_ranks(2, _save_twice, str(save_dir), env={FAULT_ENV: f"{phase}:rank0:2:stop"})
    try:
        deadline = time.time() + 180
        while process_state(procs[0].pid) != "T":
            assert time.time() < deadline, "the save never reached its fault point"
            assert all(p.is_alive() for p in procs), "a rank died before the fault point"
            time.sleep(0.2)
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    assert (save_dir / "latest").read_text() == "global_step1"
    engine = _engine(world=1, seed=7)  # a fresh single process loads what the 2-rank job left
    path, _ = engine.load_checkpoint(str(save_dir))
    assert path.endswith("global_step1") and engine.global_steps == 1
    with CheckpointReader(save_dir) as reader:  # every slice of every parameter is there
        for name in reader.params:
            reader.read_param("master", name)


def _save_from_rank0_only(save_dir: str, rank0_done: str) -> str:
    import torch.distributed as dist

    engine = _engine()
    if dist.get_rank() == 0:
        started, outcome = time.time(), "no error"
        try:
            engine.save_checkpoint(save_dir)
        except CheckpointError as e:
            outcome = f"{time.time() - started:.1f}s: {e}"
        finally:
            Path(rank0_done).write_text(outcome)
        return outcome
    # Rank 1 is busy elsewhere and never joins the save: it stays away until rank 0 has given up,
    # however long that takes on a loaded machine (a fixed sleep could end first, and its exit
    # would break rank 0's wait with another error).
    while not Path(rank0_done).exists():
        time.sleep(0.1)
    return "idle"


def test_save_called_on_one_rank_alone_fails_with_a_clear_error(tmp_path, monkeypatch):
    # The lone caller is rank 0: torch's monitored_barrier bounds only rank 0's wait by the timeout;
    # another rank alone waits for the group's own timeout (init_distributed's, 30 minutes).
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    outcome, _ = run_on_ranks(2, _save_from_rank0_only, str(tmp_path / "ckpt"), str(tmp_path / "rank0_done"))
    assert "must be called on all 2 ranks" in outcome and "Ranks 1 failed to pass" in outcome, outcome  # names the absent
    assert float(outcome.split("s:")[0]) < 30


@pytest.fixture
def saved(tmp_path):
    engine = _engine(world=1)
    _step(engine, 0)
    engine.save_checkpoint(tmp_path)
    return tmp_path, tmp_path / "global_step1"


def test_loading_a_tag_that_does_not_exist_names_it(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match="no checkpoint tag 'global_step9'.*available: global_step1"):
        _engine(world=1).load_checkpoint(root, tag="global_step9")


def test_missing_or_truncated_shard_file_is_named(saved):
    root, tag_dir = saved
    shard = tag_dir / "shards_rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="shards_rank00000.safetensors"):
        _engine(world=1).load_checkpoint(root)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard file .*shards_rank00000.safetensors"):
        _engine(world=1).load_checkpoint(root)


def test_unknown_format_is_refused(saved):
    root, tag_dir = saved
    meta = json.loads((tag_dir / "meta.json").read_text())
    meta["format"] = "deepspeed-zero/0"
    (tag_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="meta.json: unknown checkpoint format 'deepspeed-zero/0'"):
        _engine(world=1).load_checkpoint(root)


def test_no_checkpoint_yet_returns_none_like_deepspeed(tmp_path):
    assert _engine(world=1).load_checkpoint(tmp_path) == (None, None)


def test_client_state_that_needs_unpickling_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match=r"client_state\['fn'\] is a function"):
        _engine(world=1).save_checkpoint(tmp_path, client_state={"fn": lambda: 0})


def test_save_16bit_model_writes_loadable_weights(tmp_path):
    from safetensors.torch import load_file

    engine = _engine(world=1)
    _step(engine, 0)
    engine.save_16bit_model(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name, p in engine.module.named_parameters():
        assert torch.equal(weights[name], p.detach())


def _save_with_disk_full_on_rank1(save_dir: str) -> dict:
    """Saves global_step1, then global_step2 with rank 1's shard write failing with ENOSPC."""
    import errno

    import torch.distributed as dist

    from zerotrain.checkpoint import saver

    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(save_dir)
    _step(engine, 1)
    real_save_file = saver.save_file

    def disk_full(tensors, path, metadata=None):
        if dist.get_rank() == 1:
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)  # half a file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_save_file(tensors, path, metadata=metadata)

    saver.save_file = disk_full
    try:
        engine.save_checkpoint(save_dir)
    except CheckpointError as error:
        message = str(error)
    else:
        message = None
    finally:
        saver.save_file = real_save_file
    path, _ = engine.load_checkpoint(save_dir)  # what a resume would load
    return {"message": message, "loaded": path}


def test_disk_full_during_save_keeps_the_previous_checkpoint_and_names_folder_and_bytes(tmp_path):
    results = run_on_ranks(2, _save_with_disk_full_on_rank1, str(tmp_path))
    for result in results:  # every rank fails the same way, none hangs
        message = result["message"]
        assert message is not None
        assert str(tmp_path) in message and "global_step2" in message and "No space left" in message
        assert "bytes" in message and "'global_step1' is intact" in message
        assert result["loaded"].endswith("global_step1")
    assert (tmp_path / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "latest", "zero_to_fp32.py"]  # no .tmp left


def test_checkpoint_files_get_the_usual_file_mode(saved):
    umask = os.umask(0)
    os.umask(umask)
    root, _ = saved
    files = [p for p in root.rglob("*") if p.is_file() and p.name != "zero_to_fp32.py"]
    assert files and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o666 & ~umask)}
    # the converter script, as DeepSpeed's, can be run directly: ./zero_to_fp32.py . out
    assert oct((root / "zero_to_fp32.py").stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_the_tags_listed_for_a_missing_tag_are_checkpoints_only_in_step_order(saved):
    # They used to be every folder (the HF export `hf` too), in name order (step10 before step9).
    import shutil

    root, tag_dir = saved
    for step in (9, 10):
        shutil.copytree(tag_dir, root / f"step{step}")
        meta = json.loads((root / f"step{step}" / "meta.json").read_text())
        meta["counters"]["global_steps"] = step
        (root / f"step{step}" / "meta.json").write_text(json.dumps(meta))
    (root / "hf").mkdir()
    with pytest.raises(CheckpointError, match=r"available: global_step1, step9, step10\)"):
        _engine(world=1).load_checkpoint(root, tag="global_step99")
