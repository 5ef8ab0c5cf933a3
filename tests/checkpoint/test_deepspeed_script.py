"""The `zero_to_fp32.py` DeepSpeed copies into each checkpoint folder runs under `zerotrain run`, DeepSpeed
not installed, and writes DeepSpeed's own consolidated weights (the fixtures' reference, written by DeepSpeed
0.19.8 with that same script in its own venv)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["stage2_fp32", "stage3_bf16"])
def test_deepspeeds_own_zero_to_fp32_script_runs_under_zerotrain_run(case, tmp_path, zerotrain_cli):
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case / "checkpoint", folder)
    # As a user in their activated environment: `python` is this interpreter.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = zerotrain_cli("run", "python", "zero_to_fp32.py", ".", tmp_path / "out", cwd=folder, env={"PATH": path})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    theirs = load_file(str(FIXTURES / case / "zero_to_fp32.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].dtype == theirs[name].dtype for name in theirs)
