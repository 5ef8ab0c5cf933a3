"""`zerotrain run accelerate launch` with DeepSpeed says when a dynamo (torch.compile) setting is not applied.

Accelerate's DeepSpeed launcher drops the dynamo backend of its command line and config file
without a word, and ACCELERATE_DYNAMO_BACKEND in the environment would make every rank call
`engine.compile(...)`, which zerotrain does not have yet. zerotrain names each setting and its
source in one warning and runs eager. The rules (which config file, which value wins, when the
DeepSpeed launcher runs) are Accelerate's (accelerate/commands/launch.py), mirrored in
zerotrain/compat/accelerate_launch_args.py and checked here in-process; one real launch checks
the whole path.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, user_env, zerotrain_script

DEEPSPEED_YAML = (FIXTURES / "configs" / "accelerate" / "zero2.yaml").read_text()
"""`accelerate config`'s answers for ZeRO-2 (2 processes, no dynamo section)."""


def _ignored(tmp_path: Path, yaml_text: str, *words: str, env: dict[str, str] | None = None):
    from zerotrain.compat.accelerate_launch_args import read_accelerate_launch
    from zerotrain.compat.compile_settings import ignored_compile_settings

    config = tmp_path / "acc.yaml"
    config.write_text(yaml_text)
    launch = read_accelerate_launch(["--config_file", str(config), *words], env or {})
    return ignored_compile_settings(launch, env or {})


def test_config_files_dynamo_backend_under_deepspeed_is_named_with_its_source(tmp_path):
    ignored = _ignored(tmp_path, DEEPSPEED_YAML + "dynamo_config:\n  dynamo_backend: INDUCTOR\n", "train.py")
    assert [(s.value, s.source) for s in ignored.settings] == [
        ("INDUCTOR", f"dynamo_config.dynamo_backend in {tmp_path / 'acc.yaml'}")]
    assert ignored.drop_env == []
    assert "not applied" in ignored.warning() and "continues eager" in ignored.warning()


def test_older_top_level_dynamo_backend_key_counts_too(tmp_path):
    ignored = _ignored(tmp_path, DEEPSPEED_YAML + "dynamo_backend: INDUCTOR\n", "train.py")
    assert [s.value for s in ignored.settings] == ["INDUCTOR"]


def test_command_line_dynamo_backend_wins_over_the_config_file(tmp_path):
    with_dynamo = DEEPSPEED_YAML + "dynamo_config:\n  dynamo_backend: INDUCTOR\n"
    assert _ignored(tmp_path, with_dynamo, "--dynamo_backend", "no", "train.py") is None
    ignored = _ignored(tmp_path, DEEPSPEED_YAML, "--dynamo-backend=aot_eager", "train.py")
    assert [(s.value, s.source) for s in ignored.settings] == [
        ("aot_eager", "--dynamo_backend on the accelerate launch command line")]


def test_the_scripts_own_arguments_are_not_accelerates(tmp_path):
    assert _ignored(tmp_path, DEEPSPEED_YAML, "--num_processes", "2", "train.py", "--dynamo_backend", "inductor") is None


@pytest.mark.parametrize("words", [("--multi_gpu",), ("--cpu",), ("--use_fsdp",)])
def test_without_the_deepspeed_launcher_dynamo_is_left_to_accelerate(tmp_path, words):
    with_dynamo = DEEPSPEED_YAML + "dynamo_config:\n  dynamo_backend: INDUCTOR\n"
    assert _ignored(tmp_path, with_dynamo, *words, "train.py", env={"ACCELERATE_DYNAMO_BACKEND": "inductor"}) is None


def test_environment_variable_is_named_and_left_out_of_the_jobs_environment(tmp_path):
    ignored = _ignored(tmp_path, DEEPSPEED_YAML, "train.py", env={"ACCELERATE_DYNAMO_BACKEND": "inductor"})
    assert [(s.value, s.source) for s in ignored.settings] == [
        ("inductor", "ACCELERATE_DYNAMO_BACKEND in the environment")]
    assert ignored.drop_env == ["ACCELERATE_DYNAMO_BACKEND"]


def test_default_config_location_follows_hf_home_then_xdg_cache_home(tmp_path):
    from zerotrain.compat.accelerate_launch_args import default_config_file, read_accelerate_launch
    from zerotrain.compat.compile_settings import ignored_compile_settings

    assert default_config_file({"HF_HOME": "/h"}) == Path("/h/accelerate/default_config.yaml")
    assert default_config_file({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/accelerate/default_config.yaml")
    home = tmp_path / "hf-home"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(DEEPSPEED_YAML + "dynamo_backend: INDUCTOR\n")
    launch = read_accelerate_launch(["train.py"], {"HF_HOME": str(home)})
    assert ignored_compile_settings(launch, {}) is not None


PREPARE_SCRIPT = """\
from accelerate import Accelerator
import torch
accelerator = Accelerator()
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)  # DeepSpeed's micro-batch size
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
print("prepared", type(model).__name__, "dynamo", accelerator.state.dynamo_plugin.backend.value)
"""


@pytest.mark.slow  # one Accelerate rank
def test_accelerate_launch_with_dynamo_settings_warns_and_runs_eager(tmp_path):
    """Both sources at once: the config file's (dropped by Accelerate) and the environment's (which
    would make Accelerate call engine.compile: a TypeError on every rank)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "prepare.py").write_text(PREPARE_SCRIPT)
    (cwd / "acc.yaml").write_text(DEEPSPEED_YAML.replace("num_processes: 2", "num_processes: 1")
                                  + "dynamo_config:\n  dynamo_backend: INDUCTOR\n")
    env = user_env(HF_HOME=str(cwd / "hf-home"), CUDA_VISIBLE_DEVICES="", ACCELERATE_DYNAMO_BACKEND="inductor")
    proc = subprocess.run([zerotrain_script(), "run", "accelerate", "launch", "--config_file", "acc.yaml",
                           "prepare.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "prepared Engine dynamo NO" in proc.stdout
    warnings = [" ".join(line.split()) for line in proc.stderr.splitlines() if line.startswith("zerotrain run: warning")]
    assert len(warnings) == 1, proc.stderr
    assert "dynamo backend 'INDUCTOR' (dynamo_config.dynamo_backend in acc.yaml)" in warnings[0]
    assert "dynamo backend 'inductor' (ACCELERATE_DYNAMO_BACKEND in the environment)" in warnings[0]
    assert "torch.compile is not yet supported on zerotrain's DeepSpeed path" in warnings[0]
