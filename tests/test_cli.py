"""The `zerotrain` command line: help, version, argument parsing and `config check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain import __version__
from zerotrain.cli.main import build_parser, main, parse_overrides

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
GOOD_CONFIG = CONFIGS / "multinode-zero2-small.json"
# Its two "auto" values that zerotrain cannot infer without a model or data.
GOOD_CONFIG_SETS = ["--set", "scheduler.params.total_num_steps=100", "--set", "train_micro_batch_size_per_gpu=2"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], ["launch", "config", "consolidate"]),
        (["consolidate", "--help"], ["CHECKPOINT_DIR", "OUTPUT", "--tag", "--dtype", "--max-shard-size", "--hf"]),
        (["launch", "--help"], ["--num_gpus", "--nproc_per_node", "--master_port", "--no_local_rank", "SCRIPT"]),
        (["config", "--help"], ["check"]),
        (["config", "check", "--help"], ["--world-size", "--set", "PATH"]),
    ],
)
def test_help_of_each_command(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in expected:
        assert word in out


@pytest.mark.slow
def test_python_dash_m_zerotrain_prints_help_and_version():
    helped = subprocess.run([sys.executable, "-m", "zerotrain", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "usage: zerotrain" in helped.stdout
    version = subprocess.run(
        [sys.executable, "-m", "zerotrain", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout.strip() == f"zerotrain {__version__}"


def test_no_subcommand_prints_the_commands(capsys):
    # It used to be a usage error (exit 2, "the following arguments are required: COMMAND").
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zerotrain") and "launch" in out and "train" in out and "estimate" in out


def test_launch_keeps_script_arguments_for_the_script():
    args = build_parser().parse_args(
        ["launch", "--num_gpus", "2", "train.py", "--num_gpus", "7", "--help", "--deepspeed_config", "x.json"]
    )
    assert args.nproc == 2
    assert args.script == "train.py"
    assert args.script_args == ["--num_gpus", "7", "--help", "--deepspeed_config", "x.json"]
    assert (args.module, args.no_python, args.no_local_rank, args.master_port) == (False, False, False, None)


def test_launch_accepts_deepspeed_and_torchrun_spellings_of_nproc():
    parser = build_parser()
    for flag in ("--num_gpus", "--num_accelerators", "--nproc_per_node", "--nproc-per-node"):
        assert parser.parse_args(["launch", flag, "3", "t.py"]).nproc == 3


def test_parse_overrides_reads_json_values_where_they_parse():
    assert parse_overrides(["optimizer.params.lr=1e-3", "a=true", "b=[1, 2]", "c=adam", "d=x=y"]) == {
        "optimizer.params.lr": 0.001,
        "a": True,
        "b": [1, 2],
        "c": "adam",
        "d": "x=y",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["no_equals_sign"])


def test_config_check_says_valid_in_one_line_and_show_prints_the_resolved_config(capsys):
    # It used to print ~150 lines of resolved JSON, the verdict left to the exit status.
    assert main(["config", "check", str(GOOD_CONFIG), "--world-size", "4", *GOOD_CONFIG_SETS]) == 0
    verdict = capsys.readouterr().out
    assert verdict.count("\n") == 1 and f"{GOOD_CONFIG}: valid DeepSpeed config for 4 ranks: ZeRO stage 2" in verdict
    assert "train batch 8 = micro-batch 2 x 1 accumulation x 4" in verdict and "--show" in verdict
    code = main(["config", "check", str(GOOD_CONFIG), "--world-size", "4", *GOOD_CONFIG_SETS, "--show"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    resolved = json.loads(captured.out)  # the printed config is valid JSON
    assert resolved["scheduler"]["params"]["total_num_steps"] == 100
    assert resolved["train_micro_batch_size_per_gpu"] == 2
    assert resolved["train_batch_size"] == 8  # 2 per rank x 4 ranks x 1 accumulation step
    assert resolved["zero_optimization"]["stage"] == 2


def test_config_check_says_when_set_had_no_effect(capsys):
    code = main(["config", "check", str(GOOD_CONFIG), *GOOD_CONFIG_SETS, "--set", "optimizer.params.lr=1e-3", "--show"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "--set optimizer.params.lr had no effect" in captured.err
    assert json.loads(captured.out)["optimizer"]["params"]["lr"] == 0.0006


def test_config_check_rejects_a_misspelt_key_without_traceback(tmp_path, capsys):
    bad = tmp_path / "ds_config.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "zero_optimizaton": {"stage": 2}}))
    code = main(["config", "check", str(bad)])
    captured = capsys.readouterr()
    assert code == 2
    assert "zero_optimizaton" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == ""


def test_config_check_reports_unfilled_auto_values(capsys):
    code = main(["config", "check", str(GOOD_CONFIG)])
    captured = capsys.readouterr()
    assert code == 2
    assert "total_num_steps" in captured.err and "--set" in captured.err


def test_config_check_bad_set_syntax_is_a_usage_error(capsys):
    assert main(["config", "check", str(GOOD_CONFIG), "--set", "no_equals_sign"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.slow
def test_config_check_as_a_command_exits_2_on_a_bad_file(tmp_path):
    bad = tmp_path / "ds_config.json"
    bad.write_text('{"train_batch_size": 8, "zero_optimizaton": {"stage": 2}}')
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain", "config", "check", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "zero_optimizaton" in done.stderr and "Traceback" not in done.stderr
