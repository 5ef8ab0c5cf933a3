"""zerotrain works from any folder, installed editable (the test venv) or normally (a fresh venv).

The editable install used to fail outside the checkout: `zerotrain train` launches its ranks
with `-m zerotrain.train.worker`, and the module check did not see editable-install finders.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

from zerotrain import __version__
from zerotrain.compat.deepspeed_standin import VERSION

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TRAIN_ARGS = ["--training.max_steps", "2", "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400",
              "--training.eval_interval", "0", "--output.export_hf", "false"]


def _run(argv, cwd: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def package_files() -> list[str]:
    """Every file of the package in the checkout (modules and data), as paths in the wheel."""
    return sorted(path.relative_to(REPO).as_posix() for path in (REPO / "zerotrain").rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts)


@pytest.fixture(scope="module")
def normal_install(tmp_path_factory) -> Path:
    """A fresh venv with zerotrain installed from a wheel (not editable); its dependencies come
    from this venv through a .pth line, so nothing is downloaded. The wheel is in venv/../wheels."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(REPO / "zerotrain", source / "zerotrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "wheels",
          source], cwd=root)
    venv = root / "venv"
    # No pip in the venv (ensurepip is the slow part of making one): this pip installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    wheel = next((root / "wheels").glob("zerotrain-*.whl"))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    Path(site, "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def assert_two_rank_run_of_two_steps(run_dir: Path) -> None:
    """The run folder of a finished 2-step run on 2 ranks: a checkpoint of step 2, and metrics
    logged through step 2 (the last step is always logged) with a finite loss and both ranks' memory."""
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step2"
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and rows[-1]["step"] == "2", rows
    assert all(math.isfinite(float(row["loss"])) and row["mem_params_gb_r1"] != "" for row in rows), rows


@pytest.mark.slow
def test_normal_install_holds_the_version_and_every_file_of_the_package(normal_install):
    (wheel,) = (normal_install.parent / "wheels").glob("*.whl")
    assert wheel.name == f"zerotrain-{PYPROJECT['project']['version']}-py3-none-any.whl"
    assert PYPROJECT["project"]["version"] == __version__
    expected = package_files()  # data files too: the default config, workloads, presets, the stand-in
    assert "zerotrain/train/default_config.yaml" in expected and "zerotrain/compat/standin/bin/deepspeed" in expected
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = [f for f in expected if f not in names]
    assert not missing, f"not in the wheel (package-data in pyproject.toml?): {missing}"
    assert all(n.startswith("zerotrain") and "__pycache__" not in n for n in names), sorted(names)
    (site,) = (normal_install / "lib").glob("python*/site-packages")
    assert not [f for f in expected if not (site / f).is_file()], "installed without some of its files"
    assert os.stat(site / "zerotrain/compat/standin/bin/deepspeed").st_mode & stat.S_IXUSR  # a command
    scripts = {line.split("=")[0].strip() for line in (next(site.glob("zerotrain-*.dist-info")) / "entry_points.txt")
               .read_text().splitlines() if "=" in line}
    assert scripts == set(PYPROJECT["project"]["scripts"])


@pytest.mark.slow
def test_normal_install_trains_from_any_folder_with_its_own_copy(normal_install, tmp_path):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    python, zerotrain = normal_install / "bin" / "python", normal_install / "bin" / "zerotrain"
    where = _run([python, "-c", "import zerotrain; print(zerotrain.__file__)"], cwd=cwd).stdout.strip()
    assert where.startswith(str(normal_install)), where  # the installed copy, not the checkout
    # No config: the embedded default (package data), 2 ranks through `-m zerotrain.train.worker`.
    proc = _run([zerotrain, "train", "--output.dir", tmp_path / "run", "--data.cache_dir", tmp_path / "cache",
                 "--nproc_per_node", "2", *TRAIN_ARGS], cwd=cwd)
    assert "finished" in proc.stdout
    assert_two_rank_run_of_two_steps(tmp_path / "run")


@pytest.mark.slow
def test_editable_install_trains_on_two_ranks_outside_the_checkout(zerotrain_cli, tmp_path):
    proc = zerotrain_cli("train", "--output.dir", tmp_path / "run", "--data.cache_dir", tmp_path / "cache",
                         "--nproc_per_node", "2", *TRAIN_ARGS, check=True)
    assert "finished" in proc.stdout
    assert_two_rank_run_of_two_steps(tmp_path / "run")


@pytest.mark.slow
def test_launch_module_finds_a_package_in_the_working_directory(zerotrain_cli):
    package = zerotrain_cli.cwd / "mytrainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    # One write per line: ranks run unbuffered (-u) and share the pipe, so print's separate
    # writes of each word could interleave between the two ranks.
    (package / "main.py").write_text(
        "import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']} args {sys.argv[1:]}\\n\")\n"
    )
    proc = zerotrain_cli("launch", "--nproc_per_node", "2", "--module", "mytrainer.main", "--flag", check=True)
    assert "rank 0 args ['--local_rank=0', '--flag']" in proc.stdout and "rank 1" in proc.stdout


@pytest.mark.slow
def test_launch_module_that_does_not_exist_says_where_it_looked(zerotrain_cli):
    proc = zerotrain_cli("launch", "--module", "no_such_package_xyz.main")
    assert proc.returncode == 2
    assert "no_such_package_xyz" in proc.stderr and str(zerotrain_cli.cwd) in proc.stderr


@pytest.mark.slow
def test_normal_install_ships_the_deepspeed_standin(normal_install, tmp_path):
    zerotrain = normal_install / "bin" / "zerotrain"
    version = _run([zerotrain, "--version"], cwd=tmp_path).stdout.strip()
    assert version == f"zerotrain {__version__}"
    probe = ("import deepspeed, importlib.metadata, json, shutil, zerotrain; print(json.dumps({"
             "'zerotrain': zerotrain.__file__, 'module': deepspeed.__file__, 'version': deepspeed.__version__, "
             "'metadata': importlib.metadata.version('deepspeed'), 'command': shutil.which('deepspeed')}))")
    env_path = f"{normal_install / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"  # as in the activated venv
    proc = subprocess.run([str(zerotrain), "run", "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": env_path}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert all(seen[k].startswith(str(normal_install)) for k in ("zerotrain", "module", "command")), seen
    assert seen["version"] == seen["metadata"] == VERSION
    assert os.access(seen["command"], os.X_OK)
