"""A DeepSpeed JSON with comments, given to the Trainer or to Accelerate, stops before any rank starts.

zerotrain reads `#`/`//` comments, but transformers and Accelerate open the file themselves with
json.load in every rank, so such a run would die on each rank with JSONDecodeError. `zerotrain
launch` and `zerotrain run` name the file, the comment's line and a command that writes a plain
copy. Each test runs the installed console script from a temporary folder; the script would write
a marker file if it started. A DeepSpeed script's own `--deepspeed_config` (read by zerotrain)
keeps taking comments.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import hjson
import pytest

from conftest import FIXTURES, user_env, zerotrain_script

pytestmark = pytest.mark.slow  # each test starts the console script (no ranks): `make test`

TRAINER_CONFIG = FIXTURES / "configs" / "hf" / "zero2.json"
COMMENT = "# ZeRO-2 as in the transformers guide"
SCRIPT = "import pathlib; pathlib.Path('started').write_text('a rank started')\n"


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    """A user's folder: the script, and the Trainer fixture's ZeRO-2 config with a comment on line 2."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    (folder / "train.py").write_text(SCRIPT)
    lines = TRAINER_CONFIG.read_text().splitlines()
    (folder / "ds.json").write_text("\n".join([lines[0], f"    {COMMENT}", *lines[1:]]) + "\n")
    return folder


def _zerotrain(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # HF_HOME in the test's folder: no default Accelerate config of the machine's user takes part
    env = user_env(HF_HOME=str(cwd / "hf-home"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([zerotrain_script(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _assert_stopped_before_launch(proc: subprocess.CompletedProcess, cwd: Path, given_as: str, fix: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert not (cwd / "started").exists(), "a rank started"
    message = " ".join(proc.stderr.split())
    assert f"{given_as}: ds.json has a comment on line 2 ({COMMENT})" in message, message
    assert "read a DeepSpeed config file with json.load" in message
    assert "`zerotrain config check ds.json --write-json ds.plain.json`, then " + fix in message, message
    assert "Traceback" not in proc.stderr


def test_trainer_config_with_a_comment_stops_zerotrain_launch_before_any_rank(cwd):
    proc = _zerotrain(cwd, "launch", "--num_gpus", "2", "train.py", "--deepspeed", "ds.json")
    _assert_stopped_before_launch(proc, cwd, "--deepspeed ds.json", "--deepspeed ds.plain.json")


def test_trainer_config_with_a_comment_stops_zerotrain_run_torchrun_before_any_rank(cwd):
    proc = _zerotrain(cwd, "run", "torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed=ds.json")
    _assert_stopped_before_launch(proc, cwd, "--deepspeed ds.json", "--deepspeed ds.plain.json")


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
"""


def test_accelerate_config_file_naming_a_commented_json_stops_before_any_rank(cwd):
    (cwd / "acc.yaml").write_text(ACCELERATE_YAML)
    proc = _zerotrain(cwd, "run", "accelerate", "launch", "--config_file", "acc.yaml", "train.py")
    _assert_stopped_before_launch(proc, cwd, "deepspeed_config_file: ds.json under deepspeed_config in acc.yaml",
                                  "deepspeed_config_file: ds.plain.json under deepspeed_config in acc.yaml")


def test_accelerate_default_config_naming_a_commented_json_stops_before_any_rank(cwd):
    default = cwd / "hf-home" / "accelerate" / "default_config.yaml"  # where `accelerate config` writes it
    default.parent.mkdir(parents=True)
    default.write_text(ACCELERATE_YAML)
    proc = _zerotrain(cwd, "run", "accelerate", "launch", "train.py")
    _assert_stopped_before_launch(proc, cwd, f"deepspeed_config_file: ds.json under deepspeed_config in {default}",
                                  f"deepspeed_config_file: ds.plain.json under deepspeed_config in {default}")


def test_accelerate_deepspeed_config_file_flag_with_a_commented_json_stops_before_any_rank(cwd):
    proc = _zerotrain(cwd, "run", "accelerate", "launch", "--use_deepspeed", "--num_processes", "2",
                      "--deepspeed_config_file", "ds.json", "train.py")
    _assert_stopped_before_launch(proc, cwd, "--deepspeed_config_file ds.json", "--deepspeed_config_file ds.plain.json")


def test_config_check_write_json_gives_the_plain_copy_the_launch_accepts(cwd):
    proc = _zerotrain(cwd, "config", "check", "ds.json", "--write-json", "ds.plain.json")
    assert proc.returncode == 0, proc.stderr
    # the same settings, "auto" kept, in a file json.load reads
    assert json.loads((cwd / "ds.plain.json").read_text()) == hjson.loads((cwd / "ds.json").read_text())
    proc = _zerotrain(cwd, "launch", "--dry_run", "train.py", "--deepspeed", "ds.plain.json")
    assert proc.returncode == 0, proc.stderr


def test_a_deepspeed_scripts_own_config_argument_keeps_its_comments(cwd):
    """`--deepspeed --deepspeed_config ds.json` (DeepSpeed's add_config_arguments) is read by zerotrain."""
    proc = _zerotrain(cwd, "launch", "--dry_run", "train.py", "--deepspeed", "--deepspeed_config", "ds.json")
    assert proc.returncode == 0, proc.stderr
