"""The HF Trainer and Accelerate resume, on zerotrain, a checkpoint they wrote under real DeepSpeed.

tests/fixtures/deepspeed_clients/write_fixtures.py ran the client scripts on 2 CPU ranks under
DeepSpeed 0.19.8 (transformers 5.24.0, Accelerate 1.15.0; each fixture.json names the versions):
trainer_job.py saved checkpoint-3 (save_steps) at ZeRO-2 and at ZeRO-3, accelerate_job.py called
`accelerator.save_state` after step 3 at ZeRO-2, and each recorded DeepSpeed's own continuation
(--resume_from_checkpoint, `accelerator.load_state`). Here the same scripts, unchanged, with the
same arguments, resume those folders under `zerotrain launch` / `zerotrain run accelerate launch`
where no DeepSpeed is installed. fp32: the continuation's losses must equal DeepSpeed's to 1e-6
relative (same kernels on the CPU; measured bitwise at ZeRO-2, 1.2e-7 at ZeRO-3, where the gradient
reduction sums in another order), the learning rates continue and the Trainer's state continues.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, user_env, zerotrain_script
from free_ports import free_port

pytestmark = pytest.mark.slow  # starts processes: `make test`, not `make check`

CLIENTS = FIXTURES / "deepspeed_clients"
RELATIVE_TOLERANCE = 1e-6


@pytest.mark.parametrize("case", ["trainer_zero2_fp32", "trainer_zero3_fp32"])
def test_trainer_resumes_a_deepspeed_written_checkpoint_as_deepspeed_continues_it(tmp_path, case):
    fixture = json.loads((CLIENTS / case / "fixture.json").read_text())
    for name in (fixture["script"], fixture["config"], "tiny_llama.py"):  # the script imports its model
        shutil.copy(CLIENTS / name, tmp_path)
    shutil.copytree(CLIENTS / case / fixture["checkpoint"], tmp_path / fixture["checkpoint"])
    command = [zerotrain_script(), "launch", "--num_gpus", "2", "--master_port", str(free_port()),
               fixture["script"], "--deepspeed", fixture["config"], *fixture["args"],
               "--resume_from_checkpoint", fixture["checkpoint"], "--output_dir", "resumed", "--result", "resumed.json"]
    proc = subprocess.run(command, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "resumed.json").read_text())
    assert result["engine_class"] == "zerotrain.runtime.engine.Engine"
    expected = fixture["continuation"]
    after = [i for i, step in enumerate(expected["steps"]) if step > fixture["saved_at"]]
    assert [result["steps"][i] for i in after] == [expected["steps"][i] for i in after]
    assert [result["losses"][i] for i in after] == pytest.approx([expected["losses"][i] for i in after],
                                                                rel=RELATIVE_TOLERANCE)
    assert [result["learning_rates"][i] for i in after] == pytest.approx([expected["learning_rates"][i] for i in after])
    assert (result["global_step"], result["epoch"]) == (expected["global_step"], expected["epoch"])


def test_accelerate_load_state_resumes_a_deepspeed_written_state_as_deepspeed_continues_it(tmp_path):
    fixture = json.loads((CLIENTS / "accelerate_zero2_fp32" / "fixture.json").read_text())
    for name in (fixture["script"], fixture["config"], "tiny_llama.py"):  # the script imports its model
        shutil.copy(CLIENTS / name, tmp_path)
    shutil.copytree(CLIENTS / "accelerate_zero2_fp32" / fixture["state"], tmp_path / "state")
    command = [zerotrain_script(), "run", "accelerate", "launch", "--config_file", fixture["config"],
               "--main_process_port", str(free_port()), fixture["script"], "resumed", "--load_state", "state"]
    proc = subprocess.run(command, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "resumed" / "result.json").read_text())
    expected = fixture["continuation"]
    assert result["engine_class"] == "zerotrain.runtime.engine.Engine"
    assert result["steps"] == expected["steps"] == list(range(fixture["saved_at"] + 1, fixture["steps"] + 1))
    assert result["losses"] == pytest.approx(expected["losses"], rel=RELATIVE_TOLERANCE)
    assert result["learning_rates"] == pytest.approx(expected["learning_rates"])
