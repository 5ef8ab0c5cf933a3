"""Process-group set-up from any launcher's environment, and counted collectives.

Every collective the engine issues goes through the functions here so that
`COMM_COUNTER` can report the elements moved per optimizer step (the ZeRO
paper's 2Ψ / 3Ψ) — counted at the torch.distributed call, not estimated.
"""

from __future__ import annotations

import contextlib

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zerotrain.comm.teardown import destroy_default_group_at_exit

# torch 2.13 renamed the tensor collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# (rank, world size, local rank) variable names of each launcher we understand, the first
# launcher whose rank and world size are both set winning; the local rank is the first of its
# names that is set (0 if none is). Order matters: a launcher inherits the variables of the
# one that started it, so the innermost comes first: torchrun's before MPI's (the ssh and srun
# agents run torchrun's engine), MPI's before Slurm's (an mpirun inside an allocation sees the
# batch step's SLURM_PROCID). PMIx exports only PMIX_RANK, no size: Open MPI 5 sets its
# OMPI_COMM_WORLD_* as well, and srun --mpi=pmix its SLURM_*, so those entries cover PMIx.
_LAUNCHER_ENVS = (
    ("RANK", "WORLD_SIZE", ("LOCAL_RANK",)),  # torchrun, Accelerate, zerotrain launch
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),  # Open MPI 4 and 5
    # MPICH and Intel MPI (Hydra: MPI_LOCALRANKID), Cray PALS, srun --mpi=pmi2 (SLURM_LOCALID).
    ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "SLURM_LOCALID")),
    ("SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),  # srun
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Reads rank/world/local rank from torchrun, MPI or Slurm variables; a world of one otherwise."""
    env = os.environ if environ is None else environ
    for rank_key, world_key, local_keys in _LAUNCHER_ENVS:
        if rank_key in env and world_key in env:
            local_rank = next((int(env[key]) for key in local_keys if key in env), 0)
            return LaunchEnv(int(env[rank_key]), int(env[world_key]), local_rank)
    return LaunchEnv(0, 1, 0)


def init_distributed(timeout_s: float = 1800.0) -> LaunchEnv:
    """Initializes the default process group once: NCCL with CUDA, Gloo without.

    Already-initialized groups (the user's, or Accelerate's) are reused as they are.
    """
    if dist.is_initialized():
        return LaunchEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    launch = read_launch_env()
    # MPI and Slurm launchers set no rendezvous address; torch needs one.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # As DeepSpeed does under mpirun/srun: torchrun's names too, for scripts (and libraries) that read them.
    if launch.world_size > 1:
        for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                            ("LOCAL_RANK", launch.local_rank)):
            os.environ.setdefault(name, str(value))
    store = None
    if "MASTER_PORT" not in os.environ:
        if launch.world_size > 1:
            raise RuntimeError(
                "MASTER_PORT is not set: a multi-process job needs a rendezvous port. "
                "Start it with `zerotrain launch`, torchrun, or export MASTER_ADDR and MASTER_PORT."
            )
        # A lone process needs no rendezvous: an in-memory store, so no port can be taken meanwhile.
        store = dist.HashStore()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=launch.rank, world_size=launch.world_size, timeout=timedelta(seconds=timeout_s), store=store
    )
    destroy_default_group_at_exit()  # scripts may end without destroy_process_group (see teardown.py)
    return launch


def device_for(local_rank: int) -> torch.device:
    """The compute device this rank trains on."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class CommCounter:
    """Elements moved by each collective, by purpose ("grad", "param", "scalar", "init").

    Conventions (per rank, the ZeRO paper's accounting): an all-reduce of n elements
    moves 2n (it is a reduce-scatter plus an all-gather); a reduce-scatter moves its
    input's n; an all-gather moves its output's n; a broadcast moves n.
    """

    elements: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, purpose: str, n: int) -> None:
        self.elements[purpose] += n
        self.calls[purpose] += 1

    def reset(self) -> None:
        self.elements.clear()
        self.calls.clear()


COMM_COUNTER = CommCounter()
# The group engine collectives use when they name none: the default group, unless `collectives_on`.
_collective_group = None


@contextlib.contextmanager
def collectives_on(group):
    """Runs zerotrain's collectives (those that name no group) on `group`: the autotuner gives each
    trial a group of its own with a short timeout, so a rank that fails mid-trial cannot leave the
    others waiting forever, and the failed group is never used again."""
    global _collective_group
    previous, _collective_group = _collective_group, group
    try:
        yield group
    finally:
        _collective_group = previous


def _resolve(group):
    return group if group is not None else _collective_group


def all_reduce(t: torch.Tensor, purpose: str, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of `t`, counted as 2·numel."""
    COMM_COUNTER.add(purpose, 2 * t.numel())
    return dist.all_reduce(t, op=op, group=_resolve(group), async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, purpose: str, group=None, async_op: bool = False):
    """Sums `inp` over ranks and leaves rank r's 1/N chunk in `out`; counted as inp.numel()."""
    COMM_COUNTER.add(purpose, inp.numel())
    return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=_resolve(group), async_op=async_op)


def reduce_scatter_is_all_reduce(group=None) -> bool:
    """Gloo implements reduce_scatter_tensor as an all-reduce of a clone of its input, then a copy of
    the rank's chunk: on Gloo `reduce_scatter_in_place` moves the same data without the clone."""
    return dist.get_backend(_resolve(group)) == "gloo"


def reduce_scatter_in_place(t: torch.Tensor, purpose: str, group=None, async_op: bool = False):
    """Sums `t` over ranks in place, after which rank r's 1/N chunk of `t` is its reduce-scatter result.

    An all-reduce: only for backends whose reduce-scatter is one anyway (`reduce_scatter_is_all_reduce`).
    Counted as the reduce-scatter it stands for, t.numel().
    """
    COMM_COUNTER.add(purpose, t.numel())
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_resolve(group), async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, purpose: str, group=None, async_op: bool = False):
    """Concatenates every rank's `inp` into `out` (rank order); counted as out.numel()."""
    COMM_COUNTER.add(purpose, out.numel())
    return _all_gather(out, inp, group=_resolve(group), async_op=async_op)


def broadcast(t: torch.Tensor, src: int, purpose: str, group=None) -> None:
    """Broadcast from global rank `src`; counted as numel."""
    COMM_COUNTER.add(purpose, t.numel())
    dist.broadcast(t, src=src, group=_resolve(group))
