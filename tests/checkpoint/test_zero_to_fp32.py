"""DeepSpeed's zero_to_fp32 (functions and the script in every checkpoint folder) on zerotrain checkpoints.

End to end: 2 Gloo ranks train a tiny Llama (bf16, so the fp32 masters differ from the
module's weights) at stage 1 and stage 3 and save a checkpoint; the oracle is each rank's
fp32 master slices, taken from the engine itself. Format-level cases use checkpoint_fixtures.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import MODULE_ENTRIES, assert_same_tensors, load_safetensors, small_checkpoint
from safetensors.torch import load_file

from conftest import run_on_ranks
from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.layout import META
from zerotrain.checkpoint.zero_to_fp32 import (
    PARAMETER_FLAG, CheckpointNotFoundError, LazyCheckpointTensor, convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint, main,
)
from zerotrain.checkpoint.zero_to_fp32_script import SCRIPT_NAME, write_zero_to_fp32_script

WORLD = 2


def _train_and_save(stage: int, save_dir: str) -> dict:
    """Two steps on this rank, a checkpoint, the recovery script; returns this rank's fp32 master slices."""
    from llama_workload import train_zerotrain, zero_config

    from zerotrain.checkpoint.layout import param_slices_in
    from zerotrain.checkpoint.saver import module_entries
    from zerotrain.zero import GatheredParameters

    engine = train_zerotrain(zero_config(stage, WORLD, 1, "bf16"), steps=2, tied=True, freeze_one=True)["engine"]
    engine.save_checkpoint(save_dir)
    if engine.rank == 0:
        write_zero_to_fp32_script(save_dir)
    slices, shapes = {}, {}
    for fp in engine.flat_params:
        end = fp.shard_start + fp.master.numel()
        for name, start, numel, flat in param_slices_in(fp.names, fp.offsets, fp.numels, fp.shard_start, end):
            at = flat - fp.shard_start
            slices[(name, start)] = fp.master[at : at + numel].detach().clone()
        shapes.update(zip(fp.names, (tuple(s) for s in fp.shapes)))
    with GatheredParameters(list(engine.module.parameters())):  # the frozen weight, whole under stage 3 too
        whole = {n: t.detach().float().clone() for n, t in module_entries(engine).items()}
    return {"slices": slices, "shapes": shapes, "whole": whole}


def _assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """The full fp32 state dict the ranks' master slices make up (every element covered exactly)."""
    shapes = results[0]["shapes"]
    flat = {name: torch.full((torch.Size(shape).numel(),), float("nan")) for name, shape in shapes.items()}
    for result in results:
        for (name, start), piece in result["slices"].items():
            flat[name][start : start + piece.numel()] = piece
    state = {name: t.view(shapes[name]) for name, t in flat.items()}
    assert not any(t.isnan().any() for t in state.values()), "master slices do not cover every parameter"
    return {**state, **results[0]["whole"]}


@pytest.fixture(scope="module", params=[1, 3], ids=["stage1", "stage3"])
def saved(request, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the checkpoint folder 2 ranks saved into at `stage`, the engine's fp32 weights by saved name)."""
    save_dir = tmp_path_factory.mktemp(f"stage{request.param}") / "checkpoints"
    results = run_on_ranks(WORLD, _train_and_save, request.param, str(save_dir))
    return save_dir, _assemble(results)


def _run_script(cwd: Path, *args) -> subprocess.CompletedProcess:
    """The checkpoint folder's own zero_to_fp32.py, run by this venv's python as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT_NAME, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )


def _load_torch_files(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".bin":
            out.update(torch.load(f, weights_only=True))
    return out


# --- on the engine's own checkpoints ------------------------------------------------------------


@pytest.mark.slow
def test_state_dict_equals_the_engines_fp32_masters_exactly(saved):
    save_dir, masters = saved
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert_same_tensors(state, masters)
    tag = (save_dir / "latest").read_text().strip()
    assert_same_tensors(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag), masters)


def test_script_in_the_checkpoint_folder_writes_loadable_safetensors(saved, tmp_path):
    save_dir, masters = saved
    script = save_dir / SCRIPT_NAME
    assert script.is_file() and script.stat().st_mode & stat.S_IXUSR
    run = _run_script(save_dir, ".", tmp_path / "out", "--safe_serialization")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"), masters)


@pytest.mark.slow
def test_small_max_shard_size_writes_shards_and_an_index(saved, tmp_path):
    save_dir, masters = saved
    run = _run_script(save_dir, ".", tmp_path / "safe", "--safe_serialization", "--max_shard_size", "20KB")
    assert run.returncode == 0, run.stderr
    index = json.loads((tmp_path / "safe" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "safe").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert sorted(index["weight_map"]) == sorted(masters)
    assert_same_tensors(load_safetensors(shards), masters)
    # torch files, as DeepSpeed writes them without safe_serialization: plain tensors, loadable weights_only
    written = convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "bin", max_shard_size="20KB")
    assert written[-1].name == "pytorch_model.bin.index.json" and written[0].name.startswith("pytorch_model-00001-of-")
    bin_index = json.loads(written[-1].read_text())
    assert bin_index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in masters.values())
    assert set(bin_index["weight_map"].values()) == {p.name for p in written[:-1]}
    assert_same_tensors(_load_torch_files(written), masters)


def test_load_state_dict_into_a_fresh_model(saved):
    from llama_workload import make_model

    save_dir, masters = saved
    model = make_model(tied=True, freeze_one=True, seed=123)
    assert load_state_dict_from_zero_checkpoint(model, save_dir) is model
    state = model.state_dict()
    for name, want in masters.items():
        assert torch.equal(state[name], want), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives the load


# --- format-level cases ----------------------------------------------------------------------------


def _fp32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}


def test_lazy_mode_reads_each_tensor_on_contiguous(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    lazy = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    assert all(isinstance(t, LazyCheckpointTensor) for t in lazy.values())
    assert lazy["embed.weight"].shape == (13, 7) and lazy["steps"].dtype == torch.int64
    assert_same_tensors({n: t.contiguous() for n, t in lazy.items()}, _fp32(ref))


@pytest.mark.slow
def test_older_single_file_form_writes_that_file(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    write_zero_to_fp32_script(ckpt)
    run = _run_script(ckpt, ".", "pytorch_model.bin", "--max_shard_size", "100B")  # the file form never shards
    assert run.returncode == 0, run.stderr
    assert_same_tensors(torch.load(ckpt / "pytorch_model.bin", weights_only=True), _fp32(ref))
    written = convert_zero_checkpoint_to_fp32_state_dict(ckpt, output_file=tmp_path / "w.safetensors")
    assert written == [tmp_path / "w.safetensors"]
    assert_same_tensors(load_file(written[0]), _fp32(ref))


def test_exclude_frozen_parameters_keeps_buffers(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path)
    meta_path = ckpt / "global_step1" / META
    meta = json.loads(meta_path.read_text())
    meta["module"]["frozen.weight"][PARAMETER_FLAG] = True
    meta["module"]["steps"][PARAMETER_FLAG] = False
    meta_path.write_text(json.dumps(meta))
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert "frozen.weight" not in state and "steps" in state and "embed.weight" in state
    written = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out", exclude_frozen_parameters=True)
    assert sorted(torch.load(written[0], weights_only=True)) == sorted(state)


def test_exclude_frozen_parameters_without_the_record_keeps_everything_and_warns(tmp_path, caplog):
    ckpt, ref = small_checkpoint(tmp_path)
    with caplog.at_level("WARNING", logger="zerotrain"):
        state = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert sorted(state) == sorted(ref)
    assert "frozen parameters" in caplog.text and str(len(MODULE_ENTRIES)) in caplog.text


def test_rewriting_the_script_replaces_it_whole(tmp_path):
    (tmp_path / SCRIPT_NAME).write_text("stale")
    path = write_zero_to_fp32_script(tmp_path)
    assert "zerotrain.checkpoint.zero_to_fp32" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [SCRIPT_NAME]  # no temporary left
    assert stat.S_IMODE(path.stat().st_mode) & 0o111


# --- no checkpoint where one was asked for -----------------------------------------------------------


@pytest.mark.slow
def test_folder_without_a_checkpoint_is_a_clear_error_and_a_failing_script(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=rf"no zerotrain checkpoint in {empty}.*latest"):
        get_fp32_state_dict_from_zero_checkpoint(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):  # as DeepSpeed raises for a missing folder
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nowhere")
    write_zero_to_fp32_script(empty)
    run = _run_script(empty, ".", tmp_path / "out")
    assert run.returncode != 0
    assert "no zerotrain checkpoint in" in run.stderr and "latest" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_missing_latest_lists_the_tags_and_a_missing_tag_names_the_others(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path, write_latest=False)
    with pytest.raises(CheckpointNotFoundError, match=r"no `latest` file.*global_step1.*--tag"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"'global_step9'.*global_step1"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step9")


def test_a_deepspeed_format_folder_says_so(tmp_path):
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match="DeepSpeed's own format"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)


def test_main_reports_a_bad_size_with_exit_2(tmp_path, capsys):
    ckpt, _ = small_checkpoint(tmp_path)
    assert main([str(ckpt), str(tmp_path / "out"), "--max_shard_size", "lots"]) == 2
    assert "lots" in capsys.readouterr().err


@pytest.mark.slow
def test_corrupt_shard_names_the_previous_tag_with_this_same_command(tmp_path):
    from checkpoint_fixtures import small_params, write_checkpoint

    from zerotrain.checkpoint.layout import shard_file

    ckpt, _ = small_checkpoint(tmp_path)
    newest = write_checkpoint(ckpt, small_params(seed=1), tag="global_step2")
    meta = json.loads((newest / META).read_text())
    meta["counters"]["global_steps"] = 2
    (newest / META).write_text(json.dumps(meta))
    shard = newest / shard_file(1)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    write_zero_to_fp32_script(ckpt)
    run = _run_script(ckpt, ".", "out", "--safe_serialization")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert shard_file(1) in run.stderr
    assert "python zero_to_fp32.py . out --tag global_step1 --safe_serialization" in run.stderr


def test_the_script_under_a_python_without_zerotrain_names_the_python_that_trained(tmp_path):
    # It used to say `pip install zerotrain`, which installs nothing of ours.
    import shlex

    path = write_zero_to_fp32_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # -I: isolated, so this venv's site-packages (and zerotrain) are out of reach
    done = subprocess.run([sys.executable, "-I", "-S", str(path), ".", "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot import zerotrain" in done.stderr, done.stderr
    assert f"{shlex.quote(sys.executable)} zero_to_fp32.py" in done.stderr and "pip install zerotrain" not in done.stderr
