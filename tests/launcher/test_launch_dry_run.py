"""`zerotrain launch` command lines that start nothing: --dry_run's rank table and the command each
node (ssh), Slurm (srun) or MPI (mpirun) would run, and refused requests. No node is contacted.

The console script runs from a temp folder, as a user runs it (the zerotrain_cli fixture).
"""

from __future__ import annotations

import json
import re

import pytest


@pytest.mark.slow
def test_dry_run_prints_the_rank_table_and_each_node_command_without_connecting(tmp_path, zerotrain_cli):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4  # second\n")
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    done = zerotrain_cli("launch", "--hostfile", hostfile, "--include", "worker-0:0,1@worker-1:2,3",
                         "--master_addr", "10.1.2.3", "--dry_run", "train.py", "--lr", "1e-3")
    assert done.returncode == 0, done.stderr
    assert re.search(r"0\s*│\s*worker-0\s*│\s*0,1\s*│\s*0-1", done.stderr), done.stderr
    assert re.search(r"1\s*│\s*worker-1\s*│\s*2,3\s*│\s*2-3", done.stderr), done.stderr
    commands = [line for line in done.stdout.splitlines() if line.startswith("ssh ")]
    assert len(commands) == 2 and "worker-0" in commands[0] and "BatchMode=yes" in commands[0]
    jobs = [json.loads(line.split(": ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("# stdin:")]
    assert [j["node_rank"] for j in jobs] == [0, 1] and jobs[1]["slots"] == [2, 3]
    assert jobs[0]["target_args"] == ["--lr", "1e-3"] and jobs[0]["master_addr"] == "10.1.2.3"


@pytest.mark.slow
@pytest.mark.parametrize("host", ["worker-0", "localhost"])
def test_dry_run_of_a_one_host_hostfile_runs_nothing_and_another_host_is_not_this_machine(tmp_path, zerotrain_cli, host):
    # A one-host hostfile used to run the job here, --dry_run or not, whatever host it named.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{host} slots=2\n")
    marker = tmp_path / "ran"
    (zerotrain_cli.cwd / "train.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    done = zerotrain_cli("launch", "--hostfile", hostfile, "--dry_run", "train.py")
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "a dry run never runs anything"
    assert re.search(rf"0\s*│\s*{host}\s*│\s*0,1\s*│\s*0-1", done.stderr), done.stderr
    if host == "worker-0":  # started there, over ssh, like several hosts
        assert any(line.startswith("ssh ") and "worker-0" in line for line in done.stdout.splitlines()), done.stdout
    else:
        assert "would run train.py on this machine" in done.stderr and "nothing started" in done.stderr


@pytest.mark.slow
def test_slurm_launcher_starts_one_agent_per_node_with_srun_over_the_expanded_nodelist(zerotrain_cli):
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    done = zerotrain_cli("launch", "--launcher", "slurm", "--num_gpus", "4", "--launcher_args=--partition=gpu",
                         "--dry_run", "train.py", env={"SLURM_JOB_NODELIST": "gpu[01-02,07]"})
    assert done.returncode == 0, done.stderr
    (command,) = [line for line in done.stdout.splitlines() if line.startswith("srun ")]
    assert "--nodes=3" in command and "--ntasks-per-node=1" in command and "--nodelist=gpu01,gpu02,gpu07" in command
    assert "--partition=gpu" in command and "-m zerotrain.launcher.node_agent --job" in command
    assert re.search(r"gpu07\s*│\s*0,1,2,3\s*│\s*8-11", done.stderr), done.stderr


@pytest.mark.slow
def test_slurm_launcher_outside_an_allocation_says_how_to_get_one(zerotrain_cli):
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    env = {k: "" for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST")}
    done = zerotrain_cli("launch", "--launcher", "slurm", "--dry_run", "train.py", env=env)
    assert done.returncode == 2 and "salloc" in done.stderr, done.stderr


@pytest.mark.slow
def test_mpirun_command_line_for_each_mpi_launcher(zerotrain_cli, tmp_path):
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    seen = {}
    for flavour in ("openmpi", "mpich", "impi"):
        done = zerotrain_cli("launch", "--hostfile", hostfile, "--launcher", flavour, "--master_port", "29600",
                             "--dry_run", "train.py", "--lr", "1")
        assert done.returncode == 0, done.stderr
        seen[flavour] = done.stdout.strip().splitlines()[-1]
    assert seen["openmpi"].startswith("mpirun -n 4 --host worker-0:2,worker-1:2")
    assert "-x MASTER_ADDR=worker-0" in seen["openmpi"] and "-x MASTER_PORT=29600" in seen["openmpi"]
    assert seen["mpich"].startswith("mpirun -n 4 -ppn 2 -hosts worker-0,worker-1")
    assert "-genv MASTER_ADDR worker-0" in seen["mpich"] and "-genv I_MPI_PIN 0" in seen["impi"]
    for command in seen.values():
        assert command.endswith("train.py --lr 1")


@pytest.mark.slow
def test_include_with_num_nodes_is_refused_as_deepspeed_does(zerotrain_cli, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    done = zerotrain_cli("launch", "--hostfile", hostfile, "--include", "worker-0", "--num_nodes", "1",
                         "--dry_run", "train.py")
    assert done.returncode == 2 and "cannot be combined" in done.stderr


@pytest.mark.slow
def test_a_bad_hostfile_line_is_reported_with_file_line_and_fix(zerotrain_cli, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots = 2\n")
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    done = zerotrain_cli("launch", "--hostfile", hostfile, "--dry_run", "train.py")
    assert done.returncode == 2 and f"{hostfile}:2" in done.stderr and "slots=" in done.stderr, done.stderr
