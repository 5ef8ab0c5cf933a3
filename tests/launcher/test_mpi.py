"""MPI launchers: the mpirun command line of each flavour, and the requests they refuse (no MPI needed)."""

from __future__ import annotations

import pytest

from zerotrain.launcher.local import LaunchError
from zerotrain.launcher.mpi import MPI_FLAVOURS, MPIError, mpirun_argv

WORKER = ["/venv/bin/python", "-u", "train.py", "--lr", "1e-3"]
TWO_BY_TWO = {"node1": [0, 1], "node2": [0, 1]}
ENV = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "flavour,expected",
    [
        (
            "openmpi",
            [
                "mpirun", "-n", "4", "--host", "node1:2,node2:2", "--bind-to", "none",
                "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29500",
            ],
        ),
        (
            "mpich",
            [
                "mpirun", "-n", "4", "-ppn", "2", "-hosts", "node1,node2",
                "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500",
            ],
        ),
        (
            "impi",
            [
                "mpirun", "-n", "4", "-ppn", "2", "-hosts", "node1,node2",
                "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500", "-genv", "I_MPI_PIN", "0",
            ],
        ),
    ],
)
def test_mpirun_argv_starts_every_rank(flavour, expected):
    assert mpirun_argv(flavour, TWO_BY_TWO, WORKER, ENV) == expected + WORKER


@pytest.mark.parametrize("flavour", ["OpenMPI", " MPICH ", "IMPI"])
def test_flavour_names_ignore_case_and_spaces(flavour):
    assert mpirun_argv(flavour, TWO_BY_TWO, WORKER, ENV)[0] == "mpirun"


@pytest.mark.parametrize(
    "flavour,launcher_args,expected",
    [
        (
            "openmpi",
            "--mca btl_tcp_if_include eth0 --allow-run-as-root",
            [
                "mpirun", "-n", "4", "--host", "node1:2,node2:2", "--bind-to", "none",
                "--mca", "btl_tcp_if_include", "eth0", "--allow-run-as-root",
                "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29500",
            ],
        ),
        (
            "openmpi",
            "--bind-to core --map-by ppr:2:node",
            [
                "mpirun", "-n", "4", "--host", "node1:2,node2:2", "--bind-to", "core", "--map-by", "ppr:2:node",
                "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29500",
            ],
        ),
        (
            "mpich",
            "-bootstrap ssh -iface 'ib 0'",
            [
                "mpirun", "-n", "4", "-ppn", "2", "-hosts", "node1,node2", "-bootstrap", "ssh", "-iface", "ib 0",
                "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500",
            ],
        ),
        (
            "impi",
            "-genv I_MPI_PIN 1",
            [
                "mpirun", "-n", "4", "-ppn", "2", "-hosts", "node1,node2", "-genv", "I_MPI_PIN", "1",
                "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500",
            ],
        ),
    ],
    ids=["openmpi-extra", "openmpi-own-binding", "mpich-extra", "impi-own-pinning"],
)
def test_launcher_args_follow_zerotrain_options_and_replace_its_binding(flavour, launcher_args, expected):
    assert mpirun_argv(flavour, TWO_BY_TWO, WORKER, ENV, launcher_args=launcher_args) == expected + WORKER


def test_impi_pinning_from_env_wins_over_the_default():
    argv = mpirun_argv("impi", TWO_BY_TWO, WORKER, {"I_MPI_PIN": "1"})
    assert argv == ["mpirun", "-n", "4", "-ppn", "2", "-hosts", "node1,node2", "-genv", "I_MPI_PIN", "1", *WORKER]


def test_openmpi_allows_uneven_nodes_in_host_order():
    hosts = {"b-node": [0, 1, 2, 3], "a-node": [0], "c-node": [0, 1]}
    assert mpirun_argv("openmpi", hosts, ["w"], {}) == [
        "mpirun", "-n", "7", "--host", "b-node:4,a-node:1,c-node:2", "--bind-to", "none", "w",
    ]


@pytest.mark.parametrize("flavour", MPI_FLAVOURS)
def test_one_host_one_slot(flavour):
    argv = mpirun_argv(flavour, {"solo": (0,)}, ["w"], {})
    assert argv[:3] == ["mpirun", "-n", "1"] and argv[-1] == "w"
    assert ("solo:1" if flavour == "openmpi" else "solo") in argv


@pytest.mark.parametrize("flavour", MPI_FLAVOURS)
def test_env_values_are_passed_exactly(flavour):
    env = {"SPACES": "a b  c", "QUOTES": "it's \"x\"", "EQUALS": "k=v=w", "EMPTY": "", "DOLLAR": "$HOME;rm"}
    argv = mpirun_argv(flavour, TWO_BY_TWO, ["w"], env)
    for name, value in env.items():
        if flavour == "openmpi":
            assert argv[argv.index(f"{name}={value}") - 1] == "-x"
        else:
            at = argv.index(name)
            assert argv[at - 1 : at + 2] == ["-genv", name, value]


@pytest.mark.parametrize("flavour", MPI_FLAVOURS)
def test_worker_argv_comes_last_and_unchanged(flavour):
    worker = ["python", "-m", "pkg.train", "--name", "a b", "-n", "3"]
    assert mpirun_argv(flavour, TWO_BY_TWO, worker, ENV)[-len(worker):] == worker


@pytest.mark.parametrize("flavour", ["mpich", "impi"])
def test_mpich_and_impi_refuse_uneven_nodes_saying_why_and_how(flavour):
    with pytest.raises(MPIError, match="same number of ranks on every node") as caught:
        mpirun_argv(flavour, {"node1": [0, 1, 2, 3], "node2": [0, 1]}, WORKER, ENV, hostfile="/job/hostfile")
    message = str(caught.value)
    assert "node1: 4, node2: 2" in message and "/job/hostfile" in message
    assert "slots=" in message and "openmpi" in message


@pytest.mark.parametrize("flavour", MPI_FLAVOURS)
def test_chosen_gpus_are_refused_with_a_fix(flavour):
    with pytest.raises(MPIError, match="cannot run on chosen GPUs") as caught:
        mpirun_argv(flavour, {"node1": [0, 1], "node2": [1, 3]}, WORKER, ENV)
    assert "node2" in str(caught.value) and "[1, 3]" in str(caught.value)
    assert "--include node2:0,1" in str(caught.value)


@pytest.mark.parametrize(
    "flavour,hosts,worker,env,launcher_args,message",
    [
        ("pdsh", TWO_BY_TWO, WORKER, ENV, "", "unknown MPI launcher 'pdsh'"),
        ("mvapich", TWO_BY_TWO, WORKER, ENV, "", "choose one of openmpi, mpich, impi"),
        ("openmpi", {}, WORKER, ENV, "", "no hosts"),
        ("mpich", {"node1": []}, WORKER, ENV, "", "no slots"),
        ("openmpi", TWO_BY_TWO, [], ENV, "", "worker command line is empty"),
        ("openmpi", {"fe80::1": [0]}, WORKER, ENV, "", "IPv6"),
        ("mpich", {"a,b": [0]}, WORKER, ENV, "", "cannot be given"),
        ("impi", {"node1:2": [0]}, WORKER, ENV, "", "cannot be given"),
        ("impi", {"": [0]}, WORKER, ENV, "", "cannot be given"),
        ("openmpi", {"my host": [0]}, WORKER, ENV, "", "cannot be given"),
        ("openmpi", TWO_BY_TWO, WORKER, {"BAD-NAME": "1"}, "", "not an environment variable name"),
        ("mpich", TWO_BY_TWO, WORKER, {"1X": "1"}, "", "not an environment variable name"),
        ("impi", TWO_BY_TWO, WORKER, {"PORT": 29500}, "", "must be text"),
        ("mpich", TWO_BY_TWO, WORKER, ENV, "-iface 'eth0", "close the quote"),
    ],
)
def test_mpirun_argv_rejects_bad_requests(flavour, hosts, worker, env, launcher_args, message):
    with pytest.raises(MPIError, match=message):
        mpirun_argv(flavour, hosts, worker, env, launcher_args=launcher_args)


def test_mpi_error_is_a_launch_error():
    assert issubclass(MPIError, LaunchError)

