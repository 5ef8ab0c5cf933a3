"""Slurm launcher: node-list expansion, the allocation's hosts, and the srun command line (no Slurm needed)."""

from __future__ import annotations

import pytest

from zerotrain.launcher.local import LaunchError
from zerotrain.launcher.slurm import MAX_EXPANDED_HOSTS, SlurmError, expand_nodelist, slurm_hosts, srun_argv


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[001-3]", ["n001", "n002", "n003"]),
        ("n[3-3]", ["n3"]),
        ("n[7,2,5]", ["n7", "n2", "n5"]),
        ("my-host-1", ["my-host-1"]),
        ("my-host-1,my-host-2", ["my-host-1", "my-host-2"]),
        ("node-[1-2]", ["node-1", "node-2"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        # Slurm's loop order for three groups: the middle one outermost, the last innermost.
        ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("gpu1.cluster.org,gpu[2-3].cluster.org", ["gpu1.cluster.org", "gpu2.cluster.org", "gpu3.cluster.org"]),
        ("  a , b  c\t\n", ["a", "b", "c"]),
        ("gpu[1, 3-4 ]", ["gpu1", "gpu3", "gpu4"]),
        ("a,,b,", ["a", "b"]),
        ("gpu[01-02],login2,gpu[10-11]", ["gpu01", "gpu02", "login2", "gpu10", "gpu11"]),
    ],
)
def test_expand_nodelist_spells_out_every_host_in_slurm_order(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_keeps_repeated_hosts_and_order():
    assert expand_nodelist("b,a,b") == ["b", "a", "b"]


@pytest.mark.parametrize(
    "nodelist,message",
    [
        ("", "empty"),
        ("   \t", "empty"),
        (",, ,", "names no host"),
        ("gpu[1-2", "never closed"),
        ("gpu[1-2,b", "never closed"),
        ("gpu1-2]", "closes no"),
        ("a[[1-2]]", "cannot nest"),
        ("a[]", "empty item"),
        ("a[1,,2]", "empty item"),
        ("a[1,]", "empty item"),
        ("gpu[07-04]", "ends below its start"),
        ("a[x]", "neither a number nor a range"),
        ("a[1-]", "neither a number nor a range"),
        ("a[-1]", "neither a number nor a range"),
        ("a[1-2-3]", "neither a number nor a range"),
        ("a[0-99999999]", "more than"),
        (f"a[1-{MAX_EXPANDED_HOSTS // 2 + 1}],b[1-{MAX_EXPANDED_HOSTS // 2}]", "more than"),
        ("r[1-300]n[1-300]", "more than"),
    ],
)
def test_expand_nodelist_rejects_malformed_lists_naming_the_list(nodelist, message):
    with pytest.raises(SlurmError, match=message) as caught:
        expand_nodelist(nodelist)
    if nodelist.strip():
        assert repr(nodelist) in str(caught.value)


def test_expand_nodelist_error_names_the_bad_part_and_the_fix():
    with pytest.raises(SlurmError) as caught:
        expand_nodelist("ok1,gpu[07-04]")
    assert "'07-04'" in str(caught.value) and "'gpu[07-04]'" in str(caught.value)
    assert "04-07" in str(caught.value)


def test_slurm_error_is_a_launch_error():
    assert issubclass(SlurmError, LaunchError)


def test_slurm_hosts_reads_the_job_nodelist():
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODELIST": "other1"}
    assert slurm_hosts(env) == ["gpu01", "gpu02"]


def test_slurm_hosts_falls_back_to_the_older_variable():
    assert slurm_hosts({"SLURM_NODELIST": "n[1-3]"}) == ["n1", "n2", "n3"]


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_NODELIST": ""}, {"SLURM_JOB_NODELIST": "  "}, {"PATH": "/bin"}])
def test_slurm_hosts_outside_an_allocation_says_how_to_get_one(env):
    with pytest.raises(SlurmError, match="not inside a Slurm allocation") as caught:
        slurm_hosts(env)
    assert "salloc" in str(caught.value) and "sbatch" in str(caught.value)
    assert "SLURM_JOB_NODELIST" in str(caught.value)


def test_slurm_hosts_reports_a_malformed_allocation_list():
    with pytest.raises(SlurmError, match="never closed"):
        slurm_hosts({"SLURM_JOB_NODELIST": "gpu[01-02"})


AGENT = ["/usr/bin/python3", "-u", "-m", "zerotrain.launcher.node_agent", "--job", "a b"]


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (
            {},
            ["srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--kill-on-bad-exit=1", "--export=ALL"],
        ),
        (
            {"nodelist": ["gpu01", "gpu03"]},
            [
                "srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--nodelist=gpu01,gpu03",
                "--kill-on-bad-exit=1", "--export=ALL",
            ],
        ),
        (
            {"environ_names": ["MASTER_ADDR", "MASTER_PORT", "MASTER_ADDR"]},
            [
                "srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--kill-on-bad-exit=1",
                "--export=ALL,MASTER_ADDR,MASTER_PORT",
            ],
        ),
        (
            {"launcher_args": "--cpus-per-task=32 --comment 'run 7' --gpus-per-node 8"},
            [
                "srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--kill-on-bad-exit=1", "--export=ALL",
                "--cpus-per-task=32", "--comment", "run 7", "--gpus-per-node", "8",
            ],
        ),
        (
            {"launcher_args": "--export=ALL,FOO=1", "environ_names": ["MASTER_ADDR"]},
            [
                "srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--kill-on-bad-exit=1",
                "--export=ALL,MASTER_ADDR", "--export=ALL,FOO=1",
            ],
        ),
        (
            {"launcher_args": "--export MASTER_ADDR,FOO=1", "environ_names": ["MASTER_ADDR"]},
            [
                "srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--kill-on-bad-exit=1",
                "--export=ALL,MASTER_ADDR", "--export", "MASTER_ADDR,FOO=1",
            ],
        ),
    ],
    ids=["plain", "nodelist", "environ-names", "launcher-args", "user-export-all", "user-export-names"],
)
def test_srun_argv_starts_one_agent_per_node(kwargs, expected):
    assert srun_argv(2, AGENT, **kwargs) == expected + AGENT


def test_srun_argv_for_one_node():
    assert srun_argv(1, ["agent"], nodelist=["solo"]) == [
        "srun", "--nodes=1", "--ntasks-per-node=1", "--ntasks=1", "--nodelist=solo",
        "--kill-on-bad-exit=1", "--export=ALL", "agent",
    ]


def test_srun_argv_keeps_agent_arguments_exact():
    agent = ["python", "-c", "print('a; b')", "--flag=$HOME", ""]
    assert srun_argv(3, agent)[-len(agent):] == agent


@pytest.mark.parametrize(
    "num_nodes,kwargs,message",
    [
        (0, {}, "at least 1"),
        (-2, {}, "at least 1"),
        (True, {}, "at least 1"),
        (2.0, {}, "at least 1"),
        (2, {"nodelist": ["a"]}, "asked for 2 node"),
        (2, {"nodelist": ["a", "b", "c"]}, "given 3 host"),
        (2, {"nodelist": ["a", "a"]}, "more than once"),
        (2, {"nodelist": ["a", "b,c"]}, "not a single host name"),
        (2, {"nodelist": ["a", "gpu[1-2]"]}, "not a single host name"),
        (2, {"nodelist": ["a", ""]}, "not a single host name"),
        (2, {"nodelist": ["a", "b c"]}, "not a single host name"),
        (2, {"environ_names": ["OK", "1BAD"]}, "not an environment variable name"),
        (2, {"environ_names": ["A,B"]}, "not an environment variable name"),
        (2, {"launcher_args": "--comment 'unclosed"}, "close the quote"),
        (2, {"launcher_args": "--export=NONE", "environ_names": ["MASTER_ADDR"]}, "keep MASTER_ADDR"),
        (2, {"launcher_args": "--export=FOO", "environ_names": ["MASTER_ADDR", "FOO"]}, "keep MASTER_ADDR from"),
        (2, {"launcher_args": "--export NONE", "environ_names": ["MASTER_PORT"]}, "keep MASTER_PORT"),
    ],
)
def test_srun_argv_rejects_bad_requests(num_nodes, kwargs, message):
    with pytest.raises(SlurmError, match=message):
        srun_argv(num_nodes, AGENT, **kwargs)


def test_srun_argv_needs_an_agent_command():
    with pytest.raises(SlurmError, match="command line is empty"):
        srun_argv(2, [])


def test_srun_argv_user_export_error_says_how_to_fix():
    with pytest.raises(SlurmError) as caught:
        srun_argv(2, AGENT, launcher_args="--export=FOO", environ_names=["MASTER_ADDR"])
    assert "--export=ALL,FOO" in str(caught.value)
