"""Accelerate's MoE answer at ZeRO-3: `deepspeed_moe_layer_cls_names` (`accelerate config`'s question,
`--deepspeed_moe_layer_cls_names`), which Accelerate's DeepSpeed launcher hands the ranks as
ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES and its Accelerator turns into `set_z3_leaf_modules` on the
stand-in before the engine is built. One real `zerotrain run accelerate launch` on 2 CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, user_env, zerotrain_script

JOB = FIXTURES / "scripts" / "accelerate_job.py"
ZERO3_MOE_YAML = (FIXTURES / "configs" / "accelerate" / "zero2.yaml").read_text().replace(
    "zero_stage: 2", "zero_stage: 3\n  zero3_save_16bit_model: true\n"
                     "  deepspeed_moe_layer_cls_names: MixtralSparseMoeBlock,MixtralAttention")
"""`accelerate config`'s answers for ZeRO-3 with MoE layer classes: the MoE block (which DeepSpeed's
own leaf_module default flags too) and the attention, which only these names flag."""


@pytest.mark.slow  # a one-process reference, then 2 Accelerate ranks
def test_accelerates_moe_layer_classes_become_zero3_leaves_and_the_mixtral_trains_like_one_process(tmp_path):
    """A tiny Mixtral (4 experts, top-2, 2 layers) through tests/fixtures/scripts/accelerate_job.py: its
    ranks report the leaf modules Accelerate set, and the losses equal one plain-torch process on the
    global batch (1e-5, as test_accelerate.py: fp32 sums in another order), load_state replaying them."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    reference = subprocess.run([sys.executable, str(JOB), "ref", "model", "--reference", "--moe"], cwd=cwd,
                               env=user_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    (cwd / "acc.yaml").write_text(ZERO3_MOE_YAML)
    env = user_env(HF_HOME=str(cwd / "hf-home"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([zerotrain_script(), "run", "accelerate", "launch", "--config_file", "acc.yaml",
                           str(JOB), "out", "model"], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((cwd / "out" / "result.json").read_text())
    assert sorted(result["z3_leaf_modules"]) == ["MixtralAttention"] * 2 + ["MixtralSparseMoeBlock"] * 2
    expected = json.loads((cwd / "ref" / "result.json").read_text())
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert result["replayed"] == pytest.approx(result["losses"][len(result["losses"]) // 2:], abs=1e-6)
