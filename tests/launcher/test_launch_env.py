"""read_launch_env: where a process sits in the job, from the variables each launcher sets."""

from __future__ import annotations

import pytest

from zerotrain.comm.distributed import read_launch_env


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1)),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (5, 8, 1)),
        # Open MPI 5 (PRRTE) sets PMIx's variables as well as its own.
        (
            {
                "PMIX_RANK": "6", "PMIX_NAMESPACE": "prterun-x-1@1",
                "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            },
            (6, 8, 2),
        ),
        ({"PMI_RANK": "7", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3"}, (7, 8, 3)),  # MPICH / Intel MPI (Hydra)
        ({"PMI_RANK": "4", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "0"}, (4, 8, 0)),  # Cray PALS
        # srun --mpi=pmi2: PMI_RANK/PMI_SIZE from Slurm's plugin, the local rank from SLURM_LOCALID.
        (
            {"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"},
            (3, 4, 1),
        ),
        # srun --mpi=pmix: PMIx gives a rank but no size; Slurm's own variables carry the job.
        ({"PMIX_RANK": "2", "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, (2, 4, 0)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}, (5, 6, 1)),
        ({}, (0, 1, 0)),
    ],
    ids=["torchrun", "openmpi", "openmpi5-pmix", "hydra", "cray-pals", "srun-pmi2", "srun-pmix", "srun", "none"],
)
def test_each_launcher_variables_give_rank_world_and_local_rank(env, expected):
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == expected


@pytest.mark.parametrize(
    "env,expected",
    [
        # zerotrain's agents under srun or mpirun start torchrun-style workers, which inherit the
        # agent's variables: RANK/WORLD_SIZE/LOCAL_RANK describe the worker itself.
        (
            {
                "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                "PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
            },
            (9, 16, 1),
        ),
        (
            {
                "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            },
            (2, 4, 0),
        ),
        # mpirun started from a batch script: every rank inherits the batch step's SLURM_PROCID=0.
        (
            {
                "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1",
                "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
            },
            (5, 8, 1),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
            },
            (3, 8, 3),
        ),
        # Hydra inside an allocation starts its proxies with srun: the proxy's SLURM_LOCALID (0)
        # must not replace Hydra's MPI_LOCALRANKID.
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"}, (3, 4, 1)),
    ],
    ids=["torchrun-under-srun", "torchrun-under-mpirun", "hydra-in-batch", "openmpi-in-batch", "hydra-proxy-by-srun"],
)
def test_the_innermost_launcher_wins(env, expected):
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == expected


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "1"},  # a rank without a world size is not a launch
        {"PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.1.0"},  # PMIx's rank alone gives no world size
        {"PMI_SIZE": "4"},
    ],
    ids=["rank-only", "pmix-rank-only", "size-only"],
)
def test_incomplete_variables_mean_a_world_of_one(env):
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (0, 1, 0)


def test_missing_local_rank_defaults_to_zero():
    launch = read_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (launch.rank, launch.world_size, launch.local_rank) == (1, 2, 0)
