"""The `deepspeed` stand-in: on under `zerotrain run` / `zerotrain launch`, off everywhere else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import user_env, zerotrain_script
from zerotrain.compat.deepspeed_standin import VERSION

STANDIN = Path(__file__).resolve().parents[2] / "zerotrain" / "compat" / "standin"

PROBE = """
import importlib.metadata, json, shutil, deepspeed
print(json.dumps({"file": deepspeed.__file__, "version": importlib.metadata.version("deepspeed"),
                  "attr_version": deepspeed.__version__, "command": shutil.which("deepspeed"),
                  "standin": getattr(deepspeed, "__zerotrain_standin__", False)}))
"""


def _zerotrain(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([zerotrain_script(), *args], cwd=cwd, env=env or user_env(), capture_output=True, text=True,
                          timeout=240)


@pytest.fixture
def real_deepspeed(tmp_path) -> Path:
    """A folder holding a package named deepspeed with its own metadata, as a real install has."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("__version__ = '0.18.0'\nREAL = True\n")
    info = site / "deepspeed-0.18.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.0\n")
    return site


@pytest.mark.slow
def test_zerotrain_run_makes_deepspeed_the_standin_with_metadata_and_command(tmp_path):
    proc = _zerotrain("run", "--", "python", "-c", PROBE, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["standin"] and Path(found["file"]).is_relative_to(STANDIN)
    assert found["version"] == found["attr_version"] == VERSION
    assert Path(found["command"]) == STANDIN / "bin" / "deepspeed"


@pytest.mark.slow
def test_a_real_deepspeed_beside_zerotrain_is_shadowed_under_run_and_untouched_outside(tmp_path, real_deepspeed):
    env = user_env(PYTHONPATH=str(real_deepspeed))
    proc = _zerotrain("run", "python", "-c", PROBE, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == VERSION
    outside = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    found = json.loads(outside.stdout)
    assert not found["standin"] and found["version"] == "0.18.0"
    assert Path(found["file"]).is_relative_to(real_deepspeed)


@pytest.mark.slow
def test_importing_zerotrain_changes_nothing_about_deepspeed(tmp_path):
    code = ("import importlib.util, sys; before = list(sys.path); import zerotrain, zerotrain.runtime.engine; "
            "print(importlib.util.find_spec('deepspeed') is None and sys.path == before)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(), capture_output=True, text=True)
    assert proc.stdout.strip() == "True", proc.stderr


@pytest.mark.slow
def test_zerotrain_run_passes_the_exit_status_through(tmp_path):
    assert _zerotrain("run", "python", "-c", "raise SystemExit(3)", cwd=tmp_path).returncode == 3


@pytest.mark.slow
def test_zerotrain_run_names_a_missing_command(tmp_path):
    proc = _zerotrain("run", "no-such-command-here", "--flag", cwd=tmp_path)
    assert proc.returncode == 127
    assert "command not found: 'no-such-command-here'" in proc.stderr


@pytest.mark.slow
def test_zerotrain_run_without_a_command_says_what_to_give(tmp_path):
    proc = _zerotrain("run", cwd=tmp_path)
    assert proc.returncode == 2 and "no command given" in proc.stderr


def test_every_rank_of_zerotrain_launch_imports_the_standin(tmp_path):
    script = tmp_path / "probe.py"
    # one write per line: the ranks run unbuffered and share the pipe
    script.write_text("import os, sys, deepspeed\n"
                      "sys.stdout.write(f\"RANK {os.environ['RANK']} {deepspeed.__zerotrain_standin__}\\n\")\n")
    proc = _zerotrain("launch", "--num_gpus", "2", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANK 0 True" in proc.stdout and "RANK 1 True" in proc.stdout


@pytest.mark.slow
def test_the_deepspeed_command_under_run_is_zerotrain_launch(tmp_path):
    proc = _zerotrain("run", "deepspeed", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: zerotrain launch")


def test_the_standin_metadata_folder_carries_the_one_version():
    assert [p.name for p in STANDIN.glob("deepspeed-*.dist-info")] == [f"deepspeed-{VERSION}.dist-info"]
    assert f"Version: {VERSION}\n" in (STANDIN / f"deepspeed-{VERSION}.dist-info" / "METADATA").read_text()
