"""The rules of a multi-node job's environment, on names and text alone: which shell variables
are exported, the env file grammar, which names are process-specific, and --env flags."""

from __future__ import annotations

import pytest

from zerotrain.launcher.job_environment import (
    ENV_FILE_NAME,
    EXPORTED_NAMES,
    EXPORTED_PREFIXES,
    EnvFileError,
    is_exported,
    is_process_specific,
    job_environment,
    parse_env_file_text,
    parse_env_flags,
)
from zerotrain.launcher.local import LaunchError


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
