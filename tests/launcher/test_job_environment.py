"""The environment every node of a multi-node job gets: exported shell variables, env files, --env flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zerotrain.launcher.job_environment import (
    ENV_FILE_NAME,
    EXPORTED_NAMES,
    EXPORTED_PREFIXES,
    EnvFileError,
    env_file_paths,
    is_exported,
    is_process_specific,
    job_environment,
    parse_env_file_text,
    parse_env_flags,
)
from zerotrain.launcher.local import LaunchError


@pytest.fixture
def folders(tmp_path):
    """(cwd, home) as two separate empty folders."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    return cwd, home


def parse(text: str) -> dict[str, str]:
    values, warnings = parse_env_file_text(text, "f")
    assert warnings == []
    return values


# --------------------------------------------------------------------------- what is exported from the shell


def test_constants_are_deepspeeds_plus_ours():
    assert EXPORTED_PREFIXES == ("NCCL", "PYTHON", "MV2", "UCX", "GLOO_", "TORCH_", "ZEROTRAIN_")
    assert EXPORTED_NAMES == frozenset({"OMP_NUM_THREADS"})
    assert ENV_FILE_NAME == ".deepspeed_env"
    assert issubclass(EnvFileError, LaunchError)


@pytest.mark.parametrize(
    "name",
    ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "PYTHONPATH", "PYTHONHASHSEED", "MV2_USE_CUDA", "UCX_TLS",
     "GLOO_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_DISTRIBUTED_DEBUG", "ZEROTRAIN_DEBUG",
     "OMP_NUM_THREADS"],
)
def test_shell_variables_with_exported_names_are_passed(name):
    assert is_exported(name)
    env, warnings = job_environment({name: "v"}, cwd="/nonexistent-cwd", home="/nonexistent-home")
    assert env == {name: "v"} and warnings == []


@pytest.mark.parametrize(
    "name",
    ["PATH", "HOME", "LD_LIBRARY_PATH", "OMP_PROC_BIND", "GLOOX", "TORCHELASTIC_RUN_ID", "TORCH", "nccl_debug",
     "CUDA_VISIBLE_DEVICES", "RANK", "MASTER_ADDR", "SSH_CONNECTION", "MY_NCCL_DEBUG"],
)
def test_other_shell_variables_are_not_passed(name):
    assert not is_exported(name)
    env, _ = job_environment({name: "v"}, cwd="/nonexistent-cwd", home="/nonexistent-home")
    assert env == {}


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


# --------------------------------------------------------------------------- env file grammar


def test_comments_blank_lines_and_export_prefix():
    text = "# settings for the cluster\n\n   \nexport NCCL_DEBUG=INFO\n  # indented comment\nexport\tA=1\nB=2\n"
    assert parse(text) == {"NCCL_DEBUG": "INFO", "A": "1", "B": "2"}


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ("K=plain", "plain"),
        ("K=", ""),
        ("K=a=b=c", "a=b=c"),
        ("K=--opt=1 --other two", "--opt=1 --other two"),
        ("K=value # not a comment", "value # not a comment"),  # unquoted: everything after '=' exactly
        ("K=trailing space ", "trailing space "),
        ("K= leading space", " leading space"),
        ("  K=indented", "indented"),
        ("K=it's", "it's"),
        ("K=a\"b", 'a"b'),
        ("K='single quoted'", "single quoted"),
        ("K='literal \\n $HOME \"x\"'", 'literal \\n $HOME "x"'),
        ('K="double quoted"', "double quoted"),
        ('K="esc \\" \\\\ \\n \\$HOME"', 'esc " \\ \n $HOME'),
        ('K="other \\t \\x kept"', "other \\t \\x kept"),
        ("K='it''s'", "'it''s'"),  # text after the closing quote: kept as written (with a warning, below)
        ('K="a=b"', "a=b"),
        ('K=""', ""),
        ("K=''", ""),
        ('K="quoted"  # comment after the quote', "quoted"),
        ("K='quoted'#comment", "quoted"),
        ("K=$HOME/x", "$HOME/x"),  # no expansion
        ("K=ünïcødé ✓ 日本", "ünïcødé ✓ 日本"),
        ("K=a\x1cb\u2028c", "a\x1cb\u2028c"),  # not line breaks here
    ],
)
def test_values(line, value):
    values, _ = parse_env_file_text(line + "\n", "f")
    assert values == {"K": value}


def test_repeated_keys_keep_the_last_value():
    assert parse("A=1\nB=x\nA=2\nexport A=3\n") == {"A": "3", "B": "x"}


def test_windows_line_endings_and_byte_order_mark():
    assert parse('\ufeffA=1\r\nB="two words"\r\n\r\n# c\r\nC=\r\n') == {"A": "1", "B": "two words", "C": ""}


def test_unclosed_quote_keeps_the_value_as_written_and_warns():
    values, warnings = parse_env_file_text('A=1\nK="no end\n', "/x/.deepspeed_env")
    assert values == {"A": "1", "K": '"no end'}
    assert len(warnings) == 1
    assert warnings[0].startswith("/x/.deepspeed_env:2: K's value opens a \" quote that is not closed")


def test_text_after_closing_quote_keeps_the_value_as_written_and_warns():
    values, warnings = parse_env_file_text("K='a'b\n", "f")
    assert values == {"K": "'a'b"}
    assert warnings == [
        "f:1: K's value has text after its closing ' quote, so it was kept exactly as written, quotes included; "
        "quote the whole value, or put a # before a comment."
    ]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("just some words", "it has no '='"),
        ("NAME_ONLY", "`NAME_ONLY` has no '=VALUE'; write NAME_ONLY=VALUE"),
        ("export NAME_ONLY", "`NAME_ONLY` has no '=VALUE'"),
        ("K =v", "spaces before '=' after `K`"),
        ("K = v", "spaces before '=' after `K`"),
        ("=value", "`` is not a variable name"),
        ("1ABC=x", "`1ABC` is not a variable name"),
        ("BASH_FUNC_module%%=() {  eval x", "`BASH_FUNC_module%%` is not a variable name"),
        ("A-B=1", "`A-B` is not a variable name"),
        ("K=a\0b", "NUL character"),
        ("K=caf\udce9", "not valid UTF-8"),
    ],
)
def test_lines_that_are_not_key_value_are_skipped_with_a_warning(line, problem):
    values, warnings = parse_env_file_text(f"A=1\n{line}\nB=2\n", "src")
    assert values == {"A": "1", "B": "2"}
    assert len(warnings) == 1
    assert warnings[0].startswith("src:2: skipped a line that is not KEY=VALUE: ")
    assert problem in warnings[0]


def test_warnings_do_not_repeat_values_of_skipped_lines():
    _, warnings = parse_env_file_text("BAD NAME=hunter2-secret\n", "f")
    assert "hunter2" not in warnings[0]


def test_consecutive_skipped_lines_make_one_warning():
    text = "A=1\nBASH_FUNC_ml%%=() {  eval $(\n  /usr/bin/lmod bash \"$@\")\n}\nB=2\nbad line\n"
    values, warnings = parse_env_file_text(text, "src")
    assert values == {"A": "1", "B": "2"}
    assert warnings == [
        "src:2-4: skipped 3 lines that are not KEY=VALUE (line 2: `BASH_FUNC_ml%%` is not a variable name "
        "(letters, digits and _, not starting with a digit)).",
        "src:6: skipped a line that is not KEY=VALUE: it has no '='.",
    ]


def test_non_utf8_line_in_a_file_skips_only_that_line(folders):
    cwd, home = folders
    (cwd / ENV_FILE_NAME).write_bytes(b"NCCL_A=1\nNCCL_B=caf\xe9\nNCCL_C=3\n")
    env, warnings = job_environment({}, cwd=str(cwd), home=str(home))
    assert env == {"NCCL_A": "1", "NCCL_C": "3"}
    assert warnings == [f"{cwd / ENV_FILE_NAME}:2: skipped a line that is not KEY=VALUE: it is not valid UTF-8 text."]


# --------------------------------------------------------------------------- process-specific variables


@pytest.mark.parametrize(
    "name",
    ["RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
     "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "SSH_CONNECTION",
     "SSH_AUTH_SOCK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"],
)
def test_process_specific_names(name):
    assert is_process_specific(name)


@pytest.mark.parametrize("name", ["NCCL_DEBUG", "PATH", "RANKING", "MY_RANK", "ACCELERATE_MIXED_PRECISION", "__"])
def test_names_that_are_not_process_specific(name):
    assert not is_process_specific(name)


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


# --------------------------------------------------------------------------- --env flags


def test_env_flags():
    flags = ["A=1", "B=x=y", "C=", "A=2", "D=two words; $x \\ 'q' \"dq\" ✓"]
    assert parse_env_flags(flags) == {"A": "2", "B": "x=y", "C": "", "D": "two words; $x \\ 'q' \"dq\" ✓"}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("NCCL_DEBUG", "--env NCCL_DEBUG: expected KEY=VALUE, e.g. --env NCCL_DEBUG=INFO (write --env NCCL_DEBUG= "),
        ("", "--env : expected KEY=VALUE"),
        ("=1", "--env =1: `` is not a variable name"),
        ("1X=1", "--env 1X=1: `1X` is not a variable name"),
        ("A B=1", "--env A B=1: `A B` is not a variable name"),
        ("K =1", "--env K =1: `K ` is not a variable name"),
        ("RANK=0", "--env RANK=0: RANK is set separately for each process or machine, so one value cannot be given "
                   "to the whole job; leave it out."),
        ("CUDA_VISIBLE_DEVICES=0", "choose GPUs with --include HOST:SLOT,SLOT, --exclude or --num_gpus"),
        ("MASTER_ADDR=h", "use --master_addr"),
        ("MASTER_PORT=1", "use --master_port"),
    ],
)
def test_bad_env_flags_are_errors_naming_the_flag(flag, message):
    with pytest.raises(EnvFileError) as caught:
        parse_env_flags([flag])
    assert message in str(caught.value)


def test_bad_flag_is_reported_even_when_an_env_file_is_broken(folders):
    cwd, home = folders
    with pytest.raises(EnvFileError, match="--env NOPE"):
        job_environment({"DS_ENV_FILE": "missing"}, cwd=str(cwd), home=str(home), env_flags=["NOPE"])


# --------------------------------------------------------------------------- the whole job


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
