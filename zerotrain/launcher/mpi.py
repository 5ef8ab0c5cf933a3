"""MPI side of a multi-node launch: the ``mpirun`` line that starts every rank of the job.

Unlike the ssh and Slurm launchers, which start one node agent per node, an MPI
launcher starts each rank directly: ``mpirun`` puts the ranks on the nodes,
numbered contiguously per node in host order (node 0 runs ranks 0..k-1), and
tells each rank where it is through its own variables (``OMPI_COMM_WORLD_*``
for Open MPI, ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID`` for MPICH and Intel
MPI), which `zerotrain.comm.distributed.read_launch_env` reads.

The flavours and their flags follow DeepSpeed's ``openmpi``, ``mpich`` and
``impi`` launchers, with two differences. The selected hosts are named on the
command line (``--host`` / ``-hosts``) rather than handing over the whole
hostfile, so an --include/--exclude selection is honoured where DeepSpeed
refuses it. And MPI's network transport settings are left to
``launcher_args``: the ranks talk over NCCL or Gloo, not through MPI.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from zerotrain.launcher.local import LaunchError

MPI_FLAVOURS = ("openmpi", "mpich", "impi")
_FLAVOUR_TITLES = {"openmpi": "Open MPI", "mpich": "MPICH", "impi": "Intel MPI"}
# MPICH's and Intel MPI's mpirun (Hydra) take one ranks-per-node count (-ppn) for all nodes.
_SAME_COUNT_PER_NODE = ("mpich", "impi")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class MPIError(LaunchError):
    """An mpirun launch cannot be built from this request."""


def mpirun_argv(
    flavour: str,
    hosts: Mapping[str, Sequence[int]],
    worker_argv: Sequence[str],
    env: Mapping[str, str],
    *,
    launcher_args: str = "",
    hostfile: str | None = None,
) -> list[str]:
    """The ``mpirun`` command that starts one `worker_argv` process per slot of `hosts`.

    flavour: one of `MPI_FLAVOURS` (any letter case).
    hosts: host -> slots, in node order, already narrowed by --include/--exclude. Each
        host's slots must be 0..k-1: mpirun numbers a node's ranks 0..k-1 and a rank trains
        on the GPU of its local rank, so it cannot be pointed at other GPUs. MPICH and Intel
        MPI also need the same k on every host.
    env: variables every rank gets, passed as ``-x NAME=VALUE`` (Open MPI) or
        ``-genv NAME VALUE`` (MPICH, Intel MPI); the values are argv elements, kept exact.
    launcher_args: extra mpirun options, split as a shell would, placed after zerotrain's.
    hostfile: the file `hosts` was read from, named in error messages so the user knows
        what to edit. It is not given to mpirun: a hostfile lists hosts a selection may
        have left out.

    Binding is switched off (Open MPI ``--bind-to none``, Intel MPI ``I_MPI_PIN=0``)
    unless `launcher_args` or `env` choose one: mpirun would otherwise pin a rank to one
    core or socket, starving its data-loader processes and threads.
    """
    key = _flavour_key(flavour)
    if not worker_argv:
        raise MPIError("no worker command given for mpirun to start (the worker command line is empty)")
    counts = _ranks_per_host(key, hosts, hostfile)
    _check_env(env)
    user_args = _split_launcher_args(launcher_args)
    total = sum(counts.values())

    if key == "openmpi":
        argv = ["mpirun", "-n", str(total), "--host", ",".join(f"{host}:{n}" for host, n in counts.items())]
        if not any(arg.lstrip("-").startswith("bind-to") for arg in user_args):
            argv += ["--bind-to", "none"]
        argv += user_args
        for name, value in env.items():
            argv += ["-x", f"{name}={value}"]
    else:
        per_node = next(iter(counts.values()))
        argv = ["mpirun", "-n", str(total), "-ppn", str(per_node), "-hosts", ",".join(counts)]
        argv += user_args
        rank_env = dict(env)
        if key == "impi" and not any(arg.startswith("I_MPI_PIN") for arg in user_args):
            # Intel MPI pins each rank to a few cores by default; DeepSpeed turns that off too.
            rank_env.setdefault("I_MPI_PIN", "0")
        for name, value in rank_env.items():
            argv += ["-genv", name, value]
    argv += worker_argv
    return argv


def _flavour_key(flavour: str) -> str:
    key = flavour.strip().lower() if isinstance(flavour, str) else ""
    if key not in MPI_FLAVOURS:
        raise MPIError(f"unknown MPI launcher {flavour!r}: choose one of {', '.join(MPI_FLAVOURS)}")
    return key


def _ranks_per_host(key: str, hosts: Mapping[str, Sequence[int]], hostfile: str | None) -> dict[str, int]:
    """host -> number of ranks, after checking that mpirun can place exactly these ranks."""
    title = _FLAVOUR_TITLES[key]
    source = f" (hosts from {hostfile})" if hostfile else ""
    if not hosts:
        raise MPIError(f"no hosts to run on{source}: the hostfile, --include and --exclude leave none")
    counts: dict[str, int] = {}
    for host, slots in hosts.items():
        _check_host_name(key, host, source)
        slots = list(slots)
        if not slots:
            raise MPIError(f"host {host}{source} has no slots selected; drop it from the selection")
        first_slots = list(range(len(slots)))
        if slots != first_slots:
            raise MPIError(
                f"{title}'s mpirun cannot run on chosen GPUs: host {host}{source} has slots {slots} selected, but "
                f"mpirun numbers a node's ranks 0..{len(slots) - 1} and each rank uses the GPU of its number. "
                f"Select whole hosts or their first slots (`--include {host}:{','.join(map(str, first_slots))}`), "
                "or use the ssh launcher, which can pick GPUs"
            )
        counts[host] = len(slots)
    if key in _SAME_COUNT_PER_NODE and len(set(counts.values())) > 1:
        listing = ", ".join(f"{host}: {n}" for host, n in counts.items())
        raise MPIError(
            f"{title}'s mpirun starts the same number of ranks on every node (-ppn), but the selected hosts{source} "
            f"have different numbers of slots ({listing}). Give every host the same slots= count, narrow the "
            "selection with --include/--exclude so the counts match, or use the openmpi or ssh launcher, "
            "which allow uneven nodes"
        )
    return counts


def _check_host_name(key: str, host: str, source: str) -> None:
    # mpirun's host lists are comma-separated, and both kinds read a slot count after a colon.
    if not isinstance(host, str) or not host or any(c in ",:" or c.isspace() for c in host):
        hint = " (an IPv6 address? give the host's name instead)" if ":" in str(host) else ""
        raise MPIError(
            f"{host!r}{source} cannot be given to {_FLAVOUR_TITLES[key]}'s mpirun as a host: it must be a "
            f"non-empty host name without spaces, commas or colons{hint}"
        )


def _check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not isinstance(name, str) or not _VARIABLE_NAME.fullmatch(name):
            raise MPIError(
                f"{name!r} is not an environment variable name mpirun can pass to the ranks: "
                "use letters, digits and underscores, not starting with a digit"
            )
        if not isinstance(value, str):
            raise MPIError(f"the value of {name} for the ranks must be text, got {type(value).__name__} {value!r}")


def _split_launcher_args(launcher_args: str) -> list[str]:
    try:
        return shlex.split(launcher_args)
    except ValueError as error:
        raise MPIError(
            f"cannot split the launcher arguments {launcher_args!r} for mpirun ({error}); close the quote"
        ) from None
