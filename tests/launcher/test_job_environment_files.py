"""The environment every node of a multi-node job gets from env files on disk: which files are
read, what is kept from them, and how they merge with shell variables and --env flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zerotrain.launcher.job_environment import ENV_FILE_NAME, EnvFileError, env_file_paths, job_environment


@pytest.fixture
def folders(tmp_path):
    """(cwd, home) as two separate empty folders."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    return cwd, home


# --------------------------------------------------------------------------- which env files


def test_no_env_files_means_none_read(folders):
    cwd, home = folders
    assert env_file_paths({}, str(cwd), str(home)) == []


def test_home_file_comes_before_cwd_file(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_text("A=1\n")
    (home / ENV_FILE_NAME).write_text("A=2\n")
    assert env_file_paths({}, str(cwd), str(home)) == [home / ENV_FILE_NAME, cwd / ENV_FILE_NAME]


@pytest.mark.parametrize("where", ["home", "cwd"])
def test_either_env_file_alone_is_found(folders, where):
    cwd, home = folders
    folder = home if where == "home" else cwd
    (folder / ENV_FILE_NAME).write_text("A=1\n")
    assert env_file_paths({}, str(cwd), str(home)) == [folder / ENV_FILE_NAME]


def test_file_is_read_once_when_cwd_is_home(tmp_path):
    (tmp_path / ENV_FILE_NAME).write_text("A=1\n")
    assert env_file_paths({}, str(tmp_path), str(tmp_path)) == [tmp_path / ENV_FILE_NAME]


def test_a_folder_named_like_the_env_file_is_not_read(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).mkdir()
    assert env_file_paths({}, str(cwd), str(home)) == []


def test_ds_env_file_absolute_path_replaces_the_default_files(folders, tmp_path):
    cwd, home = folders
    (home / ENV_FILE_NAME).write_text("A=1\n")
    custom = tmp_path / "custom.env"
    custom.write_text("A=2\n")
    assert env_file_paths({"DS_ENV_FILE": str(custom)}, str(cwd), str(home)) == [custom]


def test_ds_env_file_bare_name_is_looked_up_in_home_then_cwd(folders):
    # DeepSpeed joins DS_ENV_FILE to the home folder and to '.', like the default name.
    cwd, home = folders
    (cwd / "team.env").write_text("A=1\n")
    (home / "team.env").write_text("A=2\n")
    assert env_file_paths({"DS_ENV_FILE": "team.env"}, str(cwd), str(home)) == [home / "team.env", cwd / "team.env"]
    (home / "team.env").unlink()
    assert env_file_paths({"DS_ENV_FILE": "team.env"}, str(cwd), str(home)) == [cwd / "team.env"]


def test_ds_env_file_tilde_means_home(folders):
    cwd, home = folders
    (home / "envs").mkdir()
    (home / "envs" / "a.env").write_text("A=1\n")
    assert env_file_paths({"DS_ENV_FILE": "~/envs/a.env"}, str(cwd), str(home)) == [home / "envs" / "a.env"]


def test_empty_ds_env_file_means_the_default(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_text("A=1\n")
    assert env_file_paths({"DS_ENV_FILE": ""}, str(cwd), str(home)) == [cwd / ENV_FILE_NAME]


def test_missing_ds_env_file_is_an_error_naming_where_it_looked(folders):
    cwd, home = folders
    with pytest.raises(EnvFileError) as caught:
        env_file_paths({"DS_ENV_FILE": "team.env"}, str(cwd), str(home))
    message = str(caught.value)
    assert message.startswith("DS_ENV_FILE=team.env names an env file, but ")
    assert f"{home / 'team.env'} or {cwd / 'team.env'} does not exist" in message
    assert "unset it to use ~/.deepspeed_env and ./.deepspeed_env" in message


def test_ds_env_file_naming_a_folder_is_an_error(folders):
    cwd, home = folders
    with pytest.raises(EnvFileError, match=rf"but {re.escape(str(cwd))} is not a file"):
        env_file_paths({"DS_ENV_FILE": str(cwd)}, str(cwd), str(home))


def test_unreadable_env_file_names_it(folders, monkeypatch):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_text("A=1\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)  # chmod does not stop root, which tests may run as
    with pytest.raises(EnvFileError, match=rf"cannot read env file {re.escape(str(cwd / ENV_FILE_NAME))}: Permission"):
        job_environment({}, cwd=str(cwd), home=str(home))


# --------------------------------------------------------------------------- what is kept from an env file


def test_non_utf8_line_in_a_file_skips_only_that_line(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_bytes(b"NCCL_A=1\nNCCL_B=caf\xe9\nNCCL_C=3\n")
    env, warnings = job_environment({}, cwd=str(cwd), home=str(home))
    assert env == {"NCCL_A": "1", "NCCL_C": "3"}
    assert warnings == [f"{cwd / ENV_FILE_NAME}:2: skipped a line that is not KEY=VALUE: it is not valid UTF-8 text."]


def test_process_specific_variables_in_env_files_are_dropped_with_one_warning(folders):
    cwd, home = folders
    (home / ENV_FILE_NAME).write_text("RANK=0\nNCCL_DEBUG=INFO\nMASTER_ADDR=10.0.0.1\n")
    (cwd / ENV_FILE_NAME).write_text("RANK=3\nCUDA_VISIBLE_DEVICES=0,1\nSSH_TTY=/dev/pts/1\nFOO=bar\n")
    env, warnings = job_environment({}, cwd=str(cwd), home=str(home))
    assert env == {"NCCL_DEBUG": "INFO", "FOO": "bar"}
    assert warnings == [
        f"ignored 4 variables from {home / ENV_FILE_NAME}, {cwd / ENV_FILE_NAME} that are set separately for each "
        "process or machine, so one value would be wrong on the others: CUDA_VISIBLE_DEVICES, MASTER_ADDR, RANK, "
        "SSH_TTY."
    ]


def test_one_dropped_variable_is_named_in_the_singular(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_text("WORLD_SIZE=8\n")
    _, warnings = job_environment({}, cwd=str(cwd), home=str(home))
    assert warnings == [f"ignored 1 variable from {cwd / ENV_FILE_NAME} that is set separately for each process "
                        "or machine, so one value would be wrong on the others: WORLD_SIZE."]


# --------------------------------------------------------------------------- the whole job


def test_bad_flag_is_reported_even_when_an_env_file_is_broken(folders):
    cwd, home = folders
    with pytest.raises(EnvFileError, match="--env NOPE"):
        job_environment({"DS_ENV_FILE": "missing"}, cwd=str(cwd), home=str(home), env_flags=["NOPE"])


def test_later_sources_win(folders):
    cwd, home = folders
    (home / ENV_FILE_NAME).write_text("NCCL_A=home\nNCCL_B=home\nNCCL_C=home\nX=home\n")
    (cwd / ENV_FILE_NAME).write_text("NCCL_B=cwd\nNCCL_C=cwd\n")
    environ = {"NCCL_A": "shell", "NCCL_B": "shell", "NCCL_C": "shell", "NCCL_D": "shell", "PATH": "/bin"}
    env, warnings = job_environment(environ, cwd=str(cwd), home=str(home), env_flags=["NCCL_C=flag", "Y=flag"])
    assert env == {"NCCL_A": "home", "NCCL_B": "cwd", "NCCL_C": "flag", "NCCL_D": "shell", "X": "home", "Y": "flag"}
    assert warnings == []


def test_ds_env_file_is_found_through_the_given_environ(folders, tmp_path):
    cwd, home = folders
    custom = tmp_path / "job.env"
    custom.write_text("A=1\n")
    (cwd / ENV_FILE_NAME).write_text("B=2\n")
    env, _ = job_environment({"DS_ENV_FILE": str(custom)}, cwd=str(cwd), home=str(home))
    assert env == {"A": "1"}  # DS_ENV_FILE itself is not exported: it only matters where the launcher runs


ODD_VALUES = [
    "two words", "semi;colon", "$HOME and ${X} and $(rm -rf /)", "back\\slash\\\\", "it's", 'say "hi"',
    "tab\there", "ünïcødé ✓ 日本語", "a=b", "`cmd`", "*?[glob]", "  padded  ", "#hash", "|&<>!",
]


@pytest.mark.parametrize("value", ODD_VALUES)
def test_odd_values_survive_a_file_flags_and_json_unchanged(folders, value):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_text(f"FROM_FILE={value}\n", encoding="utf-8")
    env, warnings = job_environment(
        {"NCCL_FROM_SHELL": value}, cwd=str(cwd), home=str(home), env_flags=[f"FROM_FLAG={value}"]
    )
    assert env == {"NCCL_FROM_SHELL": value, "FROM_FILE": value, "FROM_FLAG": value}
    assert json.loads(json.dumps(env)) == env


# What an Accelerate multi-node DeepSpeed launch leaves behind: every variable of the
# launching shell, appended again on each launch. Older Accelerate releases wrote every
# variable, including multi-line shell functions; newer ones skip values with spaces.
ACCELERATE_APPENDED = """\
SHELL=/bin/bash
NCCL_SOCKET_IFNAME=eth0
HOSTNAME=login-01
PWD=/home/ana/project
LOGNAME=ana
HOME=/home/ana
LS_COLORS=rs=0:di=01;34:ln=01;36:*.tar=01;31
SSH_CONNECTION=10.1.2.3 52144 10.1.2.4 22
CUDA_VISIBLE_DEVICES=0,1,2,3
SHLVL=1
PATH=/home/ana/venv/bin:/usr/local/bin:/usr/bin
BASH_FUNC_ml%%=() {  eval "$($LMOD_DIR/ml_cmd "$@")"
}
PYTHONPATH=/home/ana/project/src
OLDPWD=/home/ana
_=/home/ana/venv/bin/accelerate
ACCELERATE_MIXED_PRECISION=bf16
ACCELERATE_CONFIG_DS_FIELDS=deepspeed_hostfile,deepspeed_multinode_launcher,zero_stage
ACCELERATE_USE_DEEPSPEED=true
ACCELERATE_DEEPSPEED_ZERO_STAGE=2
WANDB_API_KEY=0123abcd
HOSTNAME=login-01
PWD=/home/ana/project
CUDA_VISIBLE_DEVICES=0,1,2,3
NCCL_SOCKET_IFNAME=ib0
ACCELERATE_MIXED_PRECISION=fp16
LOCAL_RANK=0
"""


def test_realistic_accelerate_appended_file(folders):
    cwd, home = folders
    path = cwd / ENV_FILE_NAME
    path.write_text(ACCELERATE_APPENDED)
    env, warnings = job_environment(
        {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "lo", "HOME": "/root"}, cwd=str(cwd), home=str(home)
    )
    assert env == {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "ib0",  # the later append wins over the earlier one and the shell
        "SHELL": "/bin/bash",
        "LOGNAME": "ana",
        "HOME": "/home/ana",
        "LS_COLORS": "rs=0:di=01;34:ln=01;36:*.tar=01;31",
        "PATH": "/home/ana/venv/bin:/usr/local/bin:/usr/bin",
        "PYTHONPATH": "/home/ana/project/src",
        "ACCELERATE_MIXED_PRECISION": "fp16",
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_hostfile,deepspeed_multinode_launcher,zero_stage",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "WANDB_API_KEY": "0123abcd",
    }
    assert warnings == [
        f"{path}:12-13: skipped 2 lines that are not KEY=VALUE (line 12: `BASH_FUNC_ml%%` is not a variable name "
        "(letters, digits and _, not starting with a digit)).",
        f"ignored 8 variables from {path} that are set separately for each process or machine, so one value would "
        "be wrong on the others: CUDA_VISIBLE_DEVICES, HOSTNAME, LOCAL_RANK, OLDPWD, PWD, SHLVL, SSH_CONNECTION, _.",
    ]
