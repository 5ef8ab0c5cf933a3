"""Checkpoints written by real DeepSpeed (tests/fixtures/deepspeed_checkpoints, see write_fixtures.py there):
zerotrain recognises them and consolidates each to DeepSpeed's own zero_to_fp32 output, bit for bit.

Every fixture was written on torch 2.13 CPU ranks (2 Gloo ranks): by DeepSpeed 0.15.4 where its name
starts with ds0.15_ (one of them with elastic_checkpoint, whose optimizer state is a list per param
group), by DeepSpeed 0.19.8 otherwise (stage3_fp32_subgroups: several sub-groups per param group;
universal_*: the 0.19.8 checkpoint of the case named after it, converted by 0.19.8's ds_to_universal.py,
compared with that case's zero_to_fp32); each fixture.json says which release wrote it. DeepSpeed is never imported here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerotrain.checkpoint import load_consolidated_state_dict
from zerotrain.checkpoint.deepspeed_layout import DeepSpeedCheckpoint, find_deepspeed_tag_dir
from zerotrain.checkpoint.deepspeed_pickle import load_deepspeed_file
from zerotrain.checkpoint.errors import CheckpointError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())
WITH_REFERENCE = [c for c in CASES if (FIXTURES / c / "zero_to_fp32.safetensors").is_file()]
# TinyModel's param groups as write_fixtures.param_groups builds them (module order, matrices, then vectors).
PARAM_GROUPS = [["embed.weight", "fc1.weight", "proj.weight"], ["fc1.bias", "frozen.bias", "proj.bias"]]


def fixture(case: str) -> dict:
    return json.loads((FIXTURES / case / "fixture.json").read_text())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes: -0.0 is not 0.0 and a NaN equals only itself, unlike torch.equal."""
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def test_every_case_of_the_minimum_matrix_is_there_written_by_the_release_its_name_says():
    wanted = {"stage0_fp32", "stage1_fp32", "stage2_fp32", "stage3_fp32", "stage2_bf16", "stage3_bf16",
              "stage2_fp16", "stage3_fp32_offload", "stage3_fp32_subgroups", "ds0.15_stage1_fp32",
              "ds0.15_stage2_fp32", "ds0.15_stage2_bf16", "ds0.15_stage3_fp32", "ds0.15_stage2_fp32_elastic",
              "universal_stage2_fp32", "universal_stage3_fp32"}
    assert wanted <= set(CASES), f"missing fixtures: {sorted(wanted - set(CASES))}"
    for case in CASES:
        assert fixture(case)["written_by"]["deepspeed"] == ("0.15.4" if case.startswith("ds0.15_") else "0.19.8"), case


def test_the_subgroups_fixture_splits_each_param_group_into_several_sub_groups():
    tag = FIXTURES / "stage3_fp32_subgroups" / "checkpoint" / "global_step3"
    checkpoint = DeepSpeedCheckpoint(tag)
    sub_groups = [[checkpoint.flat_group_of[n] for n in group] for group in PARAM_GROUPS]
    assert all(len(set(groups)) > 1 for groups in sub_groups), sub_groups
    assert len(checkpoint.optim_states[0]["fp32_flat_groups"]) == len(set(sum(sub_groups, [])))


@pytest.mark.parametrize("case", WITH_REFERENCE)
def test_consolidated_weights_equal_deepspeeds_zero_to_fp32_bitwise(case):
    ours = load_consolidated_state_dict(FIXTURES / case / "checkpoint")
    theirs = load_file(str(FIXTURES / case / "zero_to_fp32.safetensors"))
    shared = DeepSpeedCheckpoint(find_deepspeed_tag_dir(FIXTURES / case / "checkpoint", None)).aliases
    # A tied weight is written once, as zerotrain always does; DeepSpeed lists it under every name.
    assert set(theirs) - set(ours) == set(shared) == {"head.weight"}
    for alias, source in shared.items():
        assert same_bits(theirs[alias], theirs[source])
    # Stage 1 records no frozen parameters, so DeepSpeed's zero_to_fp32 drops them; zerotrain keeps the module's.
    extra = set(ours) - set(theirs)
    assert extra == ({"frozen.weight"} if fixture(case)["case"]["stage"] == 1 else set())
    if case.startswith("ds0.15_"):
        # 0.15's zero_to_fp32 casts every buffer to fp32, integers too, and leaves a 16-bit frozen parameter
        # 16-bit; zerotrain keeps the int64 buffer and widens frozen parameters to fp32 as 0.19.8 does.
        assert ours["version"].dtype == torch.int64 and theirs["version"].dtype == torch.float32
        for name in ("version", "frozen.weight"):
            if name in theirs and ours[name].dtype != theirs[name].dtype:
                assert same_bits(ours.pop(name).to(theirs[name].dtype), theirs.pop(name)), name
    differing = [name for name in theirs if name in ours and not same_bits(ours[name], theirs[name])]
    assert differing == []


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("universal_")])
def test_a_universal_folder_is_found_by_latest_universal_and_read_per_parameter(case):
    """ds_to_universal.py writes latest_universal (no latest) and one folder per parameter; the masters are
    those files (stage 2: a dict in shape; stage 3: a bare flat tensor), not the source's flat partitions."""
    save_dir = FIXTURES / case / "checkpoint"
    assert not (save_dir / "latest").exists()
    tag = find_deepspeed_tag_dir(save_dir, None)
    assert tag == save_dir / "global_step3_universal"
    checkpoint = DeepSpeedCheckpoint(tag)
    assert checkpoint.universal is not None and checkpoint.zero_stage == fixture(case)["case"]["stage"]
    for name in checkpoint.params:
        saved = load_deepspeed_file(tag / "zero" / name / "fp32.pt", bare_tensor=True)
        saved = saved["param"] if isinstance(saved, dict) else saved
        assert checkpoint.read_param("master", name).reshape(-1).equal(saved.reshape(-1)), name


def test_load_universal_reads_the_converted_folder_beside_the_original_and_is_accepted(tmp_path):
    """Users convert into the save folder they resume from: `latest` and `latest_universal` side by side.
    checkpoint.load_universal picks the universal one, as DeepSpeed's switch does; without it, `latest`."""
    import shutil

    from zerotrain.config import check_supported, load_config

    save_dir = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2_fp32" / "checkpoint", save_dir)
    universal = FIXTURES / "universal_stage2_fp32" / "checkpoint"
    shutil.copytree(universal / "global_step3_universal", save_dir / "global_step3_universal")
    shutil.copy(universal / "latest_universal", save_dir / "latest_universal")
    assert find_deepspeed_tag_dir(save_dir, None) == save_dir / "global_step3"
    assert find_deepspeed_tag_dir(save_dir, None, prefer_universal=True) == save_dir / "global_step3_universal"
    check_supported(load_config({"checkpoint": {"load_universal": True}}))  # honoured, so not refused


def test_a_planted_payload_in_a_universal_parameter_file_is_refused_and_never_runs(tmp_path):
    import shutil

    from test_deepspeed_pickle import PAYLOADS

    from zerotrain.checkpoint.deepspeed_pickle import ForeignPickleError

    copy, marker = tmp_path / "ckpt", tmp_path / "payload-ran"
    shutil.copytree(FIXTURES / "universal_stage2_fp32" / "checkpoint", copy)
    planted = copy / "global_step3_universal" / "zero" / "fc1.bias" / "fp32.pt"
    global_name = sorted(PAYLOADS)[0]
    torch.save({"param": torch.zeros(10), "hook": PAYLOADS[global_name](marker)}, planted)
    with pytest.raises(ForeignPickleError) as refused:
        load_consolidated_state_dict(copy)
    assert str(planted) in str(refused.value) and refused.value.names == [global_name]
    assert not marker.exists()


def test_stage0_fp32_masters_are_the_module_parameters():
    checkpoint = FIXTURES / "stage0_fp32" / "checkpoint"
    module = load_deepspeed_file(checkpoint / "global_step3" / "mp_rank_00_model_states.pt")["module"]
    ours = load_consolidated_state_dict(checkpoint)
    assert set(ours) == set(module) - {"head.weight"}  # head.weight shares embed.weight's storage
    assert all(same_bits(ours[name], module[name]) for name in ours)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("stage0_") and not c.endswith("fp32")])
def test_stage0_16bit_masters_are_the_optimizers_fp32_copies_by_name(case):
    """16-bit stage 0 keeps unnamed fp32 copies per group: each lands on the parameter write_fixtures put there."""
    checkpoint = FIXTURES / case / "checkpoint"
    states = load_deepspeed_file(checkpoint / "global_step3" / "mp_rank_00_model_states.pt")
    ours = load_consolidated_state_dict(checkpoint)
    for names, masters in zip(PARAM_GROUPS, states["optimizer"]["fp32_groups"]):
        for name, master in zip(names, masters):
            assert same_bits(ours[name], master), name
    assert same_bits(ours["frozen.weight"], states["module"]["frozen.weight"].float())
    assert "head.weight" not in ours


def test_a_tag_folder_and_a_save_folder_are_both_recognised_and_a_zerotrain_one_is_not(tmp_path):
    save_dir = FIXTURES / "stage2_fp32" / "checkpoint"
    assert find_deepspeed_tag_dir(save_dir, None) == save_dir / "global_step3"
    assert find_deepspeed_tag_dir(save_dir / "global_step3", None) == save_dir / "global_step3"
    assert find_deepspeed_tag_dir(save_dir, "global_step3") == save_dir / "global_step3"
    assert find_deepspeed_tag_dir(tmp_path, None) is None


def test_cli_consolidates_a_deepspeed_save_folder_and_its_tag_folder(tmp_path, zerotrain_main):
    case = FIXTURES / "stage3_bf16"
    theirs = load_file(str(case / "zero_to_fp32.safetensors"))
    for given in (case / "checkpoint", case / "checkpoint" / "global_step3"):
        out = tmp_path / given.name
        run = zerotrain_main("consolidate", given, out)
        assert run.returncode == 0, run.stderr
        written = load_file(str(out / "model.safetensors"))
        assert all(same_bits(written[n], theirs[n]) for n in written) and set(theirs) - set(written) == {"head.weight"}


def test_a_missing_rank_file_is_named(tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2_fp32" / "checkpoint", copy)
    (copy / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="rank 0 .* missing"):
        load_consolidated_state_dict(copy)


def test_zero_to_fp32_functions_read_a_deepspeed_save_folder_and_its_tag_folder():
    from zerotrain.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    case = FIXTURES / "stage2_bf16"
    theirs = load_file(str(case / "zero_to_fp32.safetensors"))
    for given in (case / "checkpoint", case / "checkpoint" / "global_step3"):
        ours = get_fp32_state_dict_from_zero_checkpoint(given)
        assert set(theirs) - set(ours) == {"head.weight"}
        assert all(same_bits(ours[n], theirs[n]) for n in ours)
    trainable = get_fp32_state_dict_from_zero_checkpoint(case / "checkpoint", exclude_frozen_parameters=True)
    assert set(ours) - set(trainable) == {"frozen.weight"}  # buffers stay, as in DeepSpeed
