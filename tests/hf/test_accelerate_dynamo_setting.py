"""`zerotrain run accelerate launch` with DeepSpeed passes the dynamo (torch.compile) answer on to the ranks.

Accelerate's DeepSpeed launcher drops the dynamo settings of its command line and config file
without a word (its other launchers write them to the ranks' ACCELERATE_DYNAMO_* variables).
zerotrain writes them as those launchers do, so the ranks' Accelerator calls `engine.compile`,
and says in one line what is compiled. The rules (which config file, which value wins, when the
DeepSpeed launcher runs) are Accelerate's (accelerate/commands/launch.py, utils/launch.py),
mirrored in zerotrain/compat/accelerate_launch_args.py and checked here in-process; one real
launch checks the whole path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, user_env, zerotrain_script

DEEPSPEED_YAML = (FIXTURES / "configs" / "accelerate" / "zero2.yaml").read_text()
"""`accelerate config`'s answers for ZeRO-2 (2 processes, no dynamo section)."""
WITH_INDUCTOR = DEEPSPEED_YAML + "dynamo_config:\n  dynamo_backend: INDUCTOR\n"


def _dynamo(tmp_path: Path, yaml_text: str, *words: str, env: dict[str, str] | None = None):
    from zerotrain.compat.accelerate_launch_args import read_accelerate_launch
    from zerotrain.compat.compile_settings import dynamo_launch

    config = tmp_path / "acc.yaml"
    config.write_text(yaml_text)
    launch = read_accelerate_launch(["--config_file", str(config), *words], env or {})
    return dynamo_launch(launch, env or {})


def test_config_files_dynamo_backend_reaches_the_ranks_as_accelerates_other_launchers_write_it(tmp_path):
    dynamo = _dynamo(tmp_path, WITH_INDUCTOR, "train.py")
    assert (dynamo.backend.value, dynamo.backend.source) == (
        "INDUCTOR", f"dynamo_config.dynamo_backend in {tmp_path / 'acc.yaml'}")
    # accelerate/utils/launch.py prepare_simple_launcher_cmd_env: the same five variables, spelled so
    assert dynamo.env == {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_MODE": "default",
                          "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
                          "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"}
    line = dynamo.announcement()
    assert "'inductor'" in line and "engine.compile" in line and "\n" not in line


def test_the_answers_of_accelerate_config_are_read_from_its_dynamo_section(tmp_path):
    answers = WITH_INDUCTOR + "  dynamo_mode: max-autotune\n  dynamo_use_fullgraph: true\n  dynamo_use_dynamic: false\n"
    dynamo = _dynamo(tmp_path, answers, "train.py")
    assert dynamo.env["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    assert dynamo.env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "True"
    assert dynamo.env["ACCELERATE_DYNAMO_USE_DYNAMIC"] == "False"


def test_older_top_level_dynamo_backend_key_counts_too(tmp_path):
    assert _dynamo(tmp_path, DEEPSPEED_YAML + "dynamo_backend: INDUCTOR\n", "train.py").backend.value == "INDUCTOR"


def test_command_line_dynamo_settings_win_over_the_config_file(tmp_path):
    off = _dynamo(tmp_path, WITH_INDUCTOR, "--dynamo_backend", "no", "train.py")
    assert not off.compiles and off.env["ACCELERATE_DYNAMO_BACKEND"] == "NO"
    dynamo = _dynamo(tmp_path, DEEPSPEED_YAML, "--dynamo-backend=aot_eager", "--dynamo_use_fullgraph", "train.py")
    assert (dynamo.backend.value, dynamo.backend.source) == (
        "aot_eager", "--dynamo_backend on the accelerate launch command line")
    assert dynamo.env["ACCELERATE_DYNAMO_BACKEND"] == "AOT_EAGER"
    assert dynamo.env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "True"


def test_the_launchs_backend_overrides_the_environments_as_accelerates_launchers_do(tmp_path):
    dynamo = _dynamo(tmp_path, DEEPSPEED_YAML, "--dynamo_backend", "no", "train.py",
                     env={"ACCELERATE_DYNAMO_BACKEND": "inductor"})
    assert dynamo.env["ACCELERATE_DYNAMO_BACKEND"] == "NO"


def test_regional_compilation_asked_for_is_engine_compile(tmp_path):
    """Accelerate's regional path would `block.compile()` each block with ZeRO's hooks inside;
    zerotrain's engine.compile is the regional compile with the hooks outside, so the ranks get
    regional off and Accelerate calls engine.compile. The line says why."""
    dynamo = _dynamo(tmp_path, WITH_INDUCTOR + "  dynamo_use_regional_compilation: true\n", "train.py")
    assert dynamo.env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "False"
    assert "regional compilation asked for is this one" in dynamo.announcement()
    from_env = _dynamo(tmp_path, DEEPSPEED_YAML, "train.py", env={
        "ACCELERATE_DYNAMO_BACKEND": "inductor", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"})
    assert from_env.env == {"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"}


def test_an_unknown_backend_or_mode_stops_the_launch_naming_the_setting(tmp_path):
    from zerotrain.config.errors import UserInputError

    with pytest.raises(UserInputError, match=r"'inductr' \(dynamo_config.dynamo_backend in .*acc.yaml\).*aot_eager"):
        _dynamo(tmp_path, DEEPSPEED_YAML + "dynamo_config:\n  dynamo_backend: inductr\n", "train.py")
    with pytest.raises(UserInputError, match="reduce-overhead"):
        _dynamo(tmp_path, WITH_INDUCTOR + "  dynamo_mode: fast\n", "train.py")
    with pytest.raises(UserInputError, match="ACCELERATE_DYNAMO_BACKEND in the environment"):
        _dynamo(tmp_path, DEEPSPEED_YAML, "train.py", env={"ACCELERATE_DYNAMO_BACKEND": "inductr"})


def test_zerotrains_backends_and_modes_are_accelerates():
    from accelerate.utils import DynamoBackend
    from accelerate.utils.constants import TORCH_DYNAMO_MODES

    from zerotrain.compat.compile_settings import DYNAMO_BACKENDS, DYNAMO_MODES

    assert set(DYNAMO_BACKENDS) == {b.value for b in DynamoBackend}
    assert set(DYNAMO_MODES) == set(TORCH_DYNAMO_MODES)


def test_the_scripts_own_arguments_are_not_accelerates(tmp_path):
    assert _dynamo(tmp_path, DEEPSPEED_YAML, "--num_processes", "2", "train.py", "--dynamo_backend", "inductor") is None


@pytest.mark.parametrize("words", [("--multi_gpu",), ("--cpu",), ("--use_fsdp",)])
def test_without_the_deepspeed_launcher_dynamo_is_left_to_accelerate(tmp_path, words):
    assert _dynamo(tmp_path, WITH_INDUCTOR, *words, "train.py", env={"ACCELERATE_DYNAMO_BACKEND": "inductor"}) is None


def test_environment_variable_reaches_the_ranks_as_it_is_and_is_said(tmp_path):
    dynamo = _dynamo(tmp_path, DEEPSPEED_YAML, "train.py", env={"ACCELERATE_DYNAMO_BACKEND": "inductor"})
    assert (dynamo.backend.value, dynamo.backend.source) == ("inductor", "ACCELERATE_DYNAMO_BACKEND in the environment")
    assert dynamo.env == {} and dynamo.compiles


def test_default_config_location_follows_hf_home_then_xdg_cache_home(tmp_path):
    from zerotrain.compat.accelerate_launch_args import default_config_file, read_accelerate_launch
    from zerotrain.compat.compile_settings import dynamo_launch

    assert default_config_file({"HF_HOME": "/h"}) == Path("/h/accelerate/default_config.yaml")
    assert default_config_file({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/accelerate/default_config.yaml")
    home = tmp_path / "hf-home"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(DEEPSPEED_YAML + "dynamo_backend: INDUCTOR\n")
    launch = read_accelerate_launch(["train.py"], {"HF_HOME": str(home)})
    assert dynamo_launch(launch, {}).compiles


JOB = FIXTURES / "scripts" / "accelerate_job.py"


@pytest.mark.slow  # a one-process reference, then 2 Accelerate ranks compiling (aot_eager)
def test_accelerate_launch_with_the_dynamo_answer_compiles_the_engine_and_trains_like_one_process(tmp_path):
    """`accelerate config`'s dynamo answers at ZeRO-3, regional compilation included, which Accelerate's
    DeepSpeed launcher alone would drop (the job would run eager). Backend aot_eager: dynamo's and
    AOTAutograd's graphs under ZeRO's hooks, without inductor's C++ builds (test_trainer_compile.py
    runs inductor). The job (tests/fixtures/scripts/accelerate_job.py) must equal one plain-torch process on the
    global batch, as test_accelerate.py's eager runs do (1e-5: fp32 sums in another order)."""
    import json

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    reference = subprocess.run([sys.executable, str(JOB), "ref", "model", "--reference"], cwd=cwd,
                               env=user_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    zero3 = DEEPSPEED_YAML.replace("zero_stage: 2", "zero_stage: 3\n  zero3_save_16bit_model: true")
    (cwd / "acc.yaml").write_text(zero3 + (
        "dynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_mode: default\n  dynamo_use_fullgraph: false\n"
        "  dynamo_use_dynamic: false\n  dynamo_use_regional_compilation: true\n"))
    env = user_env(HF_HOME=str(cwd / "hf-home"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([zerotrain_script(), "run", "accelerate", "launch", "--config_file", "acc.yaml",
                           str(JOB), "out", "model"], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("zerotrain run:")]
    assert len(said) == 1, proc.stderr
    assert said[0].startswith("zerotrain run: torch.compile: backend 'aot_eager' (dynamo_config.dynamo_backend "
                              "in acc.yaml; mode default, fullgraph False, dynamic False), applied by engine.compile")
    assert "regional compilation asked for is this one" in said[0]
    result = json.loads((cwd / "out" / "result.json").read_text())
    assert result["compiled"] is True, "Accelerate did not call engine.compile"
    expected = json.loads((cwd / "ref" / "result.json").read_text())
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert result["replayed"] == pytest.approx(result["losses"][len(result["losses"]) // 2:], abs=1e-6)
