"""Commands that need neither torch nor transformers start without importing them.

Importing torch and transformers costs ~3.5 s of CPU; `zerotrain --help`, a subcommand's --help,
`logs`, `stop`, `config check` of a DeepSpeed JSON and `bench split`/`report` need neither. Each
runs here through the installed console script with Python's import log on
(PYTHONPROFILEIMPORTTIME=1 writes one stderr line per module imported) and must not list them.
Wall time is not asserted (machines are noisy); the import log is what makes the time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES
from zerotrain.cli.main import build_parser

HEAVY = ("torch", "transformers")


def imported_modules(import_log: str) -> set[str]:
    """Every module a PYTHONPROFILEIMPORTTIME log names ("import time: SELF | CUMULATIVE | NAME")."""
    return {line.rsplit("|", 1)[1].strip() for line in import_log.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def heavy_modules(import_log: str) -> list[str]:
    """The packages of HEAVY that a PYTHONPROFILEIMPORTTIME log names."""
    return sorted({name.split(".")[0] for name in imported_modules(import_log)} & set(HEAVY))


def run_logged(cli, *args: object) -> subprocess.CompletedProcess:
    """`zerotrain ARGS` through the installed console script (conftest's zerotrain_cli: the venv's
    bin/zerotrain, run from a temporary folder), its imports logged on stderr."""
    return cli(*args, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)


def errors(proc: subprocess.CompletedProcess) -> str:
    """stderr without the import log: what went wrong, for a failed assertion's message."""
    return "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))[-2000:]


def assert_light(proc: subprocess.CompletedProcess, *args: object) -> None:
    # The log is read: it names the command's own module (so an empty or unparsed log cannot pass).
    assert "zerotrain.cli.main" in imported_modules(proc.stderr), f"no import log: {proc.stderr[-2000:]}"
    heavy = heavy_modules(proc.stderr)
    assert not heavy, f"`zerotrain {' '.join(map(str, args))}` imported {heavy}"


def subcommand_help_argvs() -> list[list[str]]:
    """`[cmd, --help]` for every subcommand of the parser, and `[cmd, sub, --help]` for nested ones."""
    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    argvs = []
    for name, sub in commands(build_parser()).items():
        argvs.append([name, "--help"])
        argvs.extend([name, inner, "--help"] for inner in commands(sub))
    return argvs


def test_the_import_log_check_sees_torch_and_transformers_at_any_depth():
    log = ("import time: self [us] | cumulative | imported package\n"
           "import time:       120 |        120 |       torch._C\n"
           "import time:      5000 |    3500000 |     torch\n"
           "import time:       500 |        900 |   transformers.utils\n"
           "import time:       300 |        300 | torchvision_like_name\n")
    assert heavy_modules(log) == ["torch", "transformers"]
    assert heavy_modules("import time:       300 |        300 | zerotrain.cli.main\n") == []


@pytest.mark.parametrize("argv", [
    ["--help"], pytest.param([], marks=pytest.mark.slow), pytest.param(["--version"], marks=pytest.mark.slow),
], ids=["help", "no-args", "version"])
def test_the_command_itself_starts_without_torch(zerotrain_cli, argv):
    proc = run_logged(zerotrain_cli, *argv)
    assert proc.returncode == 0, errors(proc)
    assert_light(proc, *argv)


@pytest.mark.slow
def test_every_subcommands_help_starts_without_torch(zerotrain_cli):
    argvs = subcommand_help_argvs()
    assert ["train", "--help"] in argvs and ["bench", "split", "--help"] in argvs
    for argv in argvs:
        proc = run_logged(zerotrain_cli, *argv)
        assert proc.returncode == 0, f"zerotrain {' '.join(argv)}: {errors(proc)}"
        assert "usage:" in proc.stdout, f"zerotrain {' '.join(argv)} printed no usage: {proc.stdout[-500:]}"
        assert_light(proc, *argv)


@pytest.mark.slow
def test_logs_and_stop_start_without_torch(zerotrain_cli, tmp_path):
    """A run folder as `zerotrain train --detach` leaves it (train/run_control.py): train.log and
    train.pid of a live process, here a shell that exits once `stop` writes the STOP file."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("step 1 loss 5.6\n")
    run = subprocess.Popen(["sh", "-c", "while [ ! -e STOP ]; do sleep 0.1; done"], cwd=run_dir)
    try:
        (run_dir / "train.pid").write_text(f"{run.pid}\n")
        logs = run_logged(zerotrain_cli, "logs", run_dir)
        assert logs.returncode == 0 and "step 1 loss 5.6" in logs.stdout, errors(logs)
        assert_light(logs, "logs")
        stop = run_logged(zerotrain_cli, "stop", run_dir, "--wait", "60")
        assert stop.returncode == 0, errors(stop)
        assert (run_dir / "STOP").exists()
        assert_light(stop, "stop")
    finally:
        if run.poll() is None:
            run.kill()
        run.wait(timeout=10)


@pytest.mark.slow
def test_config_check_of_a_deepspeed_json_starts_without_torch(zerotrain_cli, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2},
    }))
    proc = run_logged(zerotrain_cli, "config", "check", config, "--world-size", "2", "--set", "optimizer.params.lr=1e-4")
    assert proc.returncode == 0 and "valid DeepSpeed config for 2 ranks" in proc.stdout, errors(proc)
    assert_light(proc, "config", "check")


@pytest.mark.slow
def test_bench_split_and_report_start_without_torch(zerotrain_cli, tmp_path):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("node1\nnode2\nnode3\nnode4\n")
    split = run_logged(zerotrain_cli, "bench", "split", nodes, tmp_path / "hostfiles", "--nodes-per-job", "2")
    assert split.returncode == 0 and (tmp_path / "hostfiles" / "batch-002").is_file(), errors(split)
    assert_light(split, "bench", "split")
    runs = Path(shutil.copytree(FIXTURES / "bench" / "pairs", tmp_path / "pairs"))
    report = run_logged(zerotrain_cli, "bench", "report", runs, "--threshold", "100")
    assert report.returncode == 1 and "2 of 4 jobs passed" in report.stdout, errors(report)
    assert (runs / "results.csv").is_file()
    assert_light(report, "bench", "report")
