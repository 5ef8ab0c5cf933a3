"""GPUs per node and nodes are spelled the same in every command, the other tools' spellings kept as aliases."""

from __future__ import annotations

import json

import pytest

from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES

TINY = ["--config-override", "hidden_size=64", "--config-override", "intermediate_size=128",
        "--config-override", "num_hidden_layers=2", "--config-override", "num_attention_heads=4",
        "--config-override", "vocab_size=512"]


# Every spelling of each flag, paired so that each one appears at least once.
SPELLING_PAIRS = [(GPUS_PER_NODE[i], NODES[i % len(NODES)]) for i in range(max(len(GPUS_PER_NODE), len(NODES)))]


@pytest.mark.slow
@pytest.mark.parametrize("per_node, nodes", SPELLING_PAIRS, ids=[f"{p}-{n}" for p, n in SPELLING_PAIRS])
def test_estimate_and_plan_take_every_spelling_of_gpus_per_node_and_nodes(zerotrain_main, per_node, nodes):
    # Parsing, in this process: tests/planning runs both commands as the console script.
    done = zerotrain_main("estimate", "llama", *TINY, per_node, "4", nodes, "2", "--json", check=True)
    hardware = json.loads(done.stdout)["hardware"]
    assert (hardware["gpus_per_node"], hardware["nodes"]) == (4, 2)
    plan = zerotrain_main("plan", "llama", *TINY, per_node, "4", nodes, "2", "--gpu-memory", "8GB",
                          "--cpu-memory", "64GB", "--global-batch", "16", "--json", check=True)
    assert json.loads(plan.stdout)["hardware"]["world_size"] == 8


@pytest.mark.slow
def test_train_takes_gpus_per_node_for_its_process_count(zerotrain_cli):
    # The batch check runs at the world size the flag gives, before any process starts.
    done = zerotrain_cli("train", "--gpus-per-node", "3", "--zero.train_batch_size", "7",
                         "--training.micro_batch_size", "2")
    assert done.returncode == 2 and "world size 3 = 6" in done.stderr, done.stderr


@pytest.mark.slow
def test_launch_takes_gpus_per_node_and_nodes(zerotrain_cli, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n")
    (zerotrain_cli.cwd / "train.py").write_text("print('never run')\n")
    done = zerotrain_cli("launch", "--hostfile", hostfile, "--nodes", "2", "--gpus-per-node", "2", "--dry_run",
                         "train.py", check=True)
    jobs = [json.loads(line.split(": ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("# stdin:")]
    assert [j["slots"] for j in jobs] == [[0, 1], [0, 1]]


def test_the_shown_spellings_come_first():
    assert GPUS_PER_NODE[0] == "--gpus-per-node" and NODES[0] == "--nodes"
    assert {"--num_gpus", "--nproc_per_node"} <= set(GPUS_PER_NODE) and {"--num_nodes", "--nnodes"} <= set(NODES)


@pytest.mark.parametrize("spelling", ["--num_gpus"])
def test_tune_takes_every_spelling_of_gpus_per_node(zerotrain_cli, spelling):
    # Parsed (and checked) before the YAML is read: 0 ranks is refused, whichever the spelling.
    done = zerotrain_cli("tune", "missing.yaml", spelling, "0")
    assert done.returncode == 2 and "must be at least 1, got 0" in done.stderr, done.stderr


@pytest.mark.slow
def test_init_takes_the_shared_spellings(zerotrain_main):
    done = zerotrain_main("init", "llama-3.2-1b", "--nnodes", "1", "--nproc_per_node", "2", "--gpu-memory", "80GB",
                          "--cpu-memory", "64GB", "--seq-len", "512", "--global-batch", "4", "--yes", check=True)
    assert "2 (from --gpus-per-node)" in done.stdout and "1 (from --nodes)" in done.stdout, done.stdout[-2000:]
