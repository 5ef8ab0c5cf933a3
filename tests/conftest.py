"""Shared test fixtures. `run_on_ranks` is THE way tests run code on N Gloo processes; `ssh_cluster`
and `make_ssh_nodes` give real sshd "nodes" on loopback addresses (launcher and bench tests).

Tests that must also run on a GPU take a parameter made by `on_gpu(...)`: the same test, marked
`cuda`, run as a world of 1 over NCCL. Without CUDA such cases are skipped with "requires CUDA";
`make gpu-check` selects them with `-m cuda` (docs/gpu.md). Under GPU_CHECK_DRY=1 they run on the
CPU (Gloo, world of 1), so the GPU check's own scripts are exercised by CI."""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from free_ports import free_port

FIXTURES = Path(__file__).parent / "fixtures"
GPU_CHECK_DRY = os.environ.get("GPU_CHECK_DRY") == "1"


# --- the same tests on the CPU and on one GPU -----------------------------------------------

def on_gpu(value, id: str):
    """A parameter for a test's one-GPU case: marked `cuda` (skipped without CUDA, selected by the GPU check)."""
    return pytest.param(value, marks=pytest.mark.cuda, id=id)


def device_env(device: str) -> dict[str, str]:
    """Environment for a process of a test case on `device` ("cpu" or "gpu"): a CPU case hides the
    GPUs, so it tests the same thing on a GPU machine as in CI; a GPU case leaves them visible."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


# The longest modules (wall time in a full run), started first so that the pytest-xdist workers
# finish together instead of one running a long module alone at the end. Every other module
# keeps pytest's order after these. tests/test_suite_order.py checks that each one exists.
LONGEST_MODULES = (
    "launcher/test_multinode_launch.py", "faults/test_crash_consistency.py",
    "clients/test_trl.py", "hf/test_trainer.py",
    "clients/test_lightning.py",
    "train/test_train_job.py", "train/test_run_folder.py", "hf/test_accelerate.py",
    "test_error_messages.py", "gpu/test_gpu_check_dry.py", "planning/test_plan.py", "test_clean_exit.py",
    "bench/test_run.py", "zero/test_parity.py", "test_install.py", "test_launcher.py", "bench/test_comm.py",
    "launcher/test_mpi_run.py", "planning/test_wizard_as_typed.py", "test_flag_spellings.py",
)


def _module_order(item) -> int:
    path = Path(str(item.fspath)).relative_to(Path(__file__).parent).as_posix()
    return LONGEST_MODULES.index(path) if path in LONGEST_MODULES else len(LONGEST_MODULES)


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    items.sort(key=_module_order)  # stable: a module's tests stay together and in order
    if torch.cuda.is_available() or GPU_CHECK_DRY:
        return
    requires_cuda = pytest.mark.skip(reason="requires CUDA")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(requires_cuda)


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, queue, env: dict) -> None:
    # A forked rank starts with the fork server's environment: take the test's, as a spawned one would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # N processes share 2 cores: avoid oversubscription
    try:
        # Plain pickle to bytes: torch's queue reducers would pass tensors through
        # shared memory that vanishes when this process exits.
        result = pickle.dumps(fn(*args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# What every CPU rank imports anyway. A fork server imports it once per test process and forks
# each rank from there: a fresh process for each rank, without ~3.5 s of CPU importing torch and
# transformers again (over a hundred ranks in a full run). GPU ranks are spawned: CUDA must not
# be touched before a fork, and an import may probe it. Tests whose ranks must import these
# themselves (transformers binds its DeepSpeed integration at import) or that measure a rank's
# memory pass `spawn=True`: a bare interpreter, nothing inherited.
RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
                "zerotrain", "llama_workload"]


def _rank_context(device: str, spawn: bool):
    import torch

    gpu = device != "cpu" and torch.cuda.is_available()  # a dry GPU check's "gpu" ranks are CPU ones
    if spawn or gpu or not hasattr(os, "fork"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def start_ranks(world_size: int, fn, *args, env: dict | None = None, device: str = "cpu", spawn: bool = False):
    """Starts `fn(*args)` on `world_size` fresh processes; returns (processes, result queue).

    Each rank gets this process's environment plus `env`. For tests that must interrupt the
    ranks (e.g. kill them mid-save); others use `run_on_ranks`.
    """
    ctx = _rank_context(device, spawn)
    queue = ctx.Queue()
    port = free_port()
    rank_env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, queue, rank_env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, queue


def run_on_ranks(world_size: int, fn, *args, timeout: float = 240.0, device: str = "cpu", spawn: bool = False) -> list:
    """Runs `fn(*args)` on `world_size` fresh processes (env set as torchrun does).

    `fn` must be a module-level function. Returns the per-rank results, rank order.
    A rank's exception fails the test with that rank's traceback; a hang fails at `timeout`.
    `device="gpu"` leaves the GPUs visible (the engine then takes NCCL and cuda:LOCAL_RANK).
    CPU ranks are forked from a server that imported torch and transformers (RANK_PRELOAD);
    `spawn=True` starts them from a bare interpreter instead.
    The rendezvous port is free when chosen but may be taken before rank 0 binds it (EADDRINUSE):
    then the ranks start again on another port, at most twice.
    """
    for attempt in range(3):
        results, errors = _run_once(world_size, fn, args, timeout, device, spawn)
        if not (errors and "EADDRINUSE" in errors[0] and attempt < 2):
            break
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return [results[r] for r in range(world_size)]


def _run_once(world_size: int, fn, args: tuple, timeout: float, device: str, spawn: bool) -> tuple[dict, list[str]]:
    procs, queue = start_ranks(world_size, fn, *args, env=device_env(device), device=device, spawn=spawn)
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        import queue as queue_mod

        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                errors.append(f"timed out after {timeout}s waiting for ranks")
                break
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks are likely blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    return results, errors


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


# Spawned ranks import test modules by name; make tests/ importable for them.
sys.path.insert(0, str(Path(__file__).parent))


# --- the installed `zerotrain` console script, run as a user runs it -------------------------

def zerotrain_script() -> str:
    """The `zerotrain` console script installed beside this interpreter (the venv's bin/)."""
    script = Path(sys.executable).parent / "zerotrain"
    if not script.is_file():
        pytest.fail(f"no installed console script at {script}: install zerotrain into this venv (make install)")
    return str(script)


class ZerotrainCLI:
    """Runs `zerotrain ARGS` through the installed console script in a fresh process.

    The working directory is a temporary folder, never the repo root, so a test
    only passes if the command works from wherever a user happens to be.
    """

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd

    def __call__(self, *args, env: dict | None = None, timeout: float = 300.0, check: bool = False,
                 cwd: Path | None = None, input: str | None = None):
        import subprocess

        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.run(
            [zerotrain_script(), *map(str, args)], cwd=cwd or self.cwd, env=full_env,
            capture_output=True, text=True, timeout=timeout, input=input,
        )
        return _checked(proc, check)


def _checked(proc, check: bool):
    """`proc`, after asserting it exited 0 when `check` (with the ends of its output if not)."""
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _command_folder(tmp_path: Path) -> Path:
    """The working directory a test's commands run from: tmp_path/cwd, never the repo root."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    return cwd


@pytest.fixture
def zerotrain_cli(tmp_path: Path) -> ZerotrainCLI:
    """`zerotrain_cli("train", "--output.dir", d, check=True)`: the console script, run from tmp_path/cwd."""
    return ZerotrainCLI(_command_folder(tmp_path))


class ZerotrainInProcess:
    """Runs `zerotrain ARGS` through `zerotrain.cli.main.main` inside this test process.

    The console script's own parser and handlers, without the 3-7 CPU-s a fresh process spends
    importing torch and transformers: for the variations of a command (its --json, --wide, a bad
    value) once another call in the module has run it as a user does (ZerotrainCLI). Same working
    directory and environment rules; returns a CompletedProcess like ZerotrainCLI.
    """

    def __init__(self, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cwd, self.monkeypatch = cwd, monkeypatch

    def __call__(self, *args, env: dict | None = None, check: bool = False, input: str | None = None):
        import contextlib
        import io
        import subprocess

        from zerotrain.cli.main import main
        from zerotrain.system.process_exit import exit_code_of

        out, err = io.StringIO(), io.StringIO()
        with self.monkeypatch.context() as patch:
            patch.chdir(self.cwd)
            for name, value in {"OMP_NUM_THREADS": "1", **(env or {})}.items():
                patch.setenv(name, str(value))
            patch.setattr(sys, "stdin", io.StringIO(input or ""))
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main([str(a) for a in args])
                except SystemExit as exit_request:  # argparse's usage errors, as the process would exit
                    code = exit_code_of(exit_request)
        return _checked(subprocess.CompletedProcess(["zerotrain", *map(str, args)], code, out.getvalue(), err.getvalue()),
                        check)


@pytest.fixture
def zerotrain_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ZerotrainInProcess:
    """`zerotrain_main("plan", "llama", "--json")`: the command in this process, run from tmp_path/cwd."""
    return ZerotrainInProcess(_command_folder(tmp_path), monkeypatch)


@pytest.fixture
def standin_deepspeed(monkeypatch):
    """`import deepspeed` gives zerotrain's stand-in (with its metadata), for this test only."""
    import importlib

    from zerotrain.compat.deepspeed_standin import STANDIN_DIR

    before = {name for name in sys.modules if name.split(".")[0] == "deepspeed"}
    monkeypatch.syspath_prepend(str(STANDIN_DIR))
    importlib.invalidate_caches()
    yield importlib.import_module("deepspeed")
    for name in [n for n in sys.modules if n.split(".")[0] == "deepspeed" and n not in before]:
        del sys.modules[name]


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user whose venv is activated: this venv's bin/ first on PATH (python,
    torchrun, accelerate are its own), one thread per rank, and no `deepspeed` stand-in: only a
    `zerotrain` command may bring it in (a test that activated it in-process must not leak it)."""
    from zerotrain.compat.deepspeed_standin import ACTIVE_ENV, COMMANDS_DIR, PYTHON_ENV, STANDIN_DIR

    def entries(name: str, drop: Path) -> list[str]:
        return [p for p in os.environ.get(name, "").split(os.pathsep) if p and Path(p) != drop]

    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in (ACTIVE_ENV, PYTHON_ENV, "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([venv_bin, *(p for p in entries("PATH", COMMANDS_DIR) if p != venv_bin)])
    if entries("PYTHONPATH", STANDIN_DIR):
        env["PYTHONPATH"] = os.pathsep.join(entries("PYTHONPATH", STANDIN_DIR))
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


# --- real sshd "nodes" on loopback addresses (tests/launcher/sshd_nodes.py) --------------------

from collections.abc import Iterator, Sequence  # noqa: E402

from launcher.sshd_nodes import INSTALL_HINT, SSHD, SshCluster, start_ssh_nodes, stop_ssh_nodes  # noqa: E402

def _require_sshd() -> None:
    # Not a skip: without sshd the multi-node launcher would go untested, silently.
    if not SSHD.is_file():
        pytest.fail(f"the launcher tests need {SSHD}: {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def ssh_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    """Two nodes, 127.0.0.2 (alias node1) and 127.0.0.3 (node2), shared by the whole session."""
    _require_sshd()
    cluster = start_ssh_nodes(tmp_path_factory.mktemp("ssh-nodes"), ["127.0.0.2", "127.0.0.3"])
    yield cluster
    stop_ssh_nodes(cluster)


@pytest.fixture
def make_ssh_nodes(tmp_path):
    """Factory: ``make_ssh_nodes(addresses, nofile_limit=..., set_env=...)`` starts nodes of
    the test's own (in tmp_path), all stopped when the test ends."""
    _require_sshd()
    clusters: list[SshCluster] = []

    def make(addresses: Sequence[str] = ("127.0.0.2",), **settings) -> SshCluster:
        cluster = start_ssh_nodes(tmp_path / f"ssh-nodes-{len(clusters)}", addresses, **settings)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        stop_ssh_nodes(cluster)
