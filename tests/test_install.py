"""zerotrain works from any folder, installed editable (the test venv) or normally (a fresh venv).

The editable install used to fail outside the checkout: `zerotrain train` launches its ranks
with `-m zerotrain.train.worker`, and the module check did not see editable-install finders.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from zerotrain.compat.deepspeed_standin import VERSION

REPO = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["--training.max_steps", "2", "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "400",
              "--training.eval_interval", "0", "--output.export_hf", "false"]


def _run(argv, cwd: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
    import os

    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def normal_install(tmp_path_factory) -> Path:
    """A fresh venv with zerotrain installed from a wheel (not editable); its dependencies come
    from this venv through a .pth line, so nothing is downloaded."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(REPO / "zerotrain", source / "zerotrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "wheels",
          source], cwd=root)
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=root)
    python = venv / "bin" / "python"
    wheel = next((root / "wheels").glob("zerotrain-*.whl"))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    Path(site, "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


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
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step2"


@pytest.mark.slow
def test_editable_install_trains_on_two_ranks_outside_the_checkout(zerotrain_cli, tmp_path):
    proc = zerotrain_cli("train", "--output.dir", tmp_path / "run", "--data.cache_dir", tmp_path / "cache",
                         "--nproc_per_node", "2", *TRAIN_ARGS, check=True)
    assert "finished" in proc.stdout


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
    probe = ("import deepspeed, importlib.metadata, shutil; "
             "print(deepspeed.__file__, importlib.metadata.version('deepspeed'), shutil.which('deepspeed'))")
    import os

    env_path = f"{normal_install / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"  # as in the activated venv
    proc = subprocess.run([str(zerotrain), "run", "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": env_path}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    module, version, command = proc.stdout.split()
    assert module.startswith(str(normal_install)) and version == VERSION
    assert os.access(command, os.X_OK) and command.startswith(str(normal_install))
