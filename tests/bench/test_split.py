"""`zerotrain bench split`: node lists and hostfiles cut into hostfiles of K nodes, in order."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotrain.bench.split import SplitError, plan_split, read_nodes, write_batches
from zerotrain.launcher.hostfile import HostfileError, parse_hostfile


def _node_list(tmp_path: Path, text: str, name: str = "nodes.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _split(tmp_path: Path, node_count: int, k: int, slots: int | None = None) -> tuple[list[Path], list[str]]:
    nodes = _node_list(tmp_path, "".join(f"node{i}\n" for i in range(1, node_count + 1)))
    hosts, _ = read_nodes(nodes)
    plan = plan_split(hosts, k, slots, str(nodes))
    return write_batches(plan, tmp_path / "hostfiles", force=False), plan.leftover


@pytest.mark.parametrize(
    ("node_count", "k", "expected", "leftover"),
    [
        (1, 1, [["node1"]], []),
        (4, 1, [["node1"], ["node2"], ["node3"], ["node4"]], []),
        (4, 2, [["node1", "node2"], ["node3", "node4"]], []),
        (4, 4, [["node1", "node2", "node3", "node4"]], []),
        (5, 1, [["node1"], ["node2"], ["node3"], ["node4"], ["node5"]], []),
        (5, 2, [["node1", "node2"], ["node3", "node4"]], ["node5"]),
        (5, 4, [["node1", "node2", "node3", "node4"]], ["node5"]),
    ],
)
def test_node_list_is_cut_into_batches_of_k_in_order_with_the_remainder_left_out(
    tmp_path, node_count, k, expected, leftover
):
    written, left = _split(tmp_path, node_count, k)
    assert [p.name for p in written] == [f"batch-{i:03d}" for i in range(1, len(expected) + 1)]
    assert sorted(p.name for p in (tmp_path / "hostfiles").iterdir()) == [p.name for p in written]
    assert [list(parse_hostfile(p)) for p in written] == expected
    assert left == leftover


@pytest.mark.parametrize(("node_count", "k"), [(1, 2), (1, 4), (4, 5)])
def test_more_nodes_per_job_than_nodes_is_an_error_naming_the_count(tmp_path, node_count, k):
    with pytest.raises(SplitError, match=rf"--nodes-per-job {k} is more than the {node_count} node"):
        _split(tmp_path, node_count, k)


def test_plain_list_gets_one_slot_per_node_unless_slots_is_given(tmp_path):
    written, _ = _split(tmp_path, 2, 2)
    assert written[0].read_text() == "node1 slots=1\nnode2 slots=1\n"
    (tmp_path / "eight").mkdir()
    written, _ = _split(tmp_path / "eight", 2, 2, slots=8)
    assert parse_hostfile(written[0]) == {"node1": 8, "node2": 8}


def test_hostfile_input_keeps_its_slots_and_slots_flag_replaces_them(tmp_path):
    hostfile = _node_list(tmp_path, "# the rack\nbig slots=8\n\nsmall slots=4  # half\n", "hostfile")
    hosts, was_hostfile = read_nodes(hostfile)
    assert was_hostfile and hosts == {"big": 8, "small": 4}
    kept = write_batches(plan_split(hosts, 1, None, "hostfile"), tmp_path / "kept", force=False)
    assert [parse_hostfile(p) for p in kept] == [{"big": 8}, {"small": 4}]
    replaced = write_batches(plan_split(hosts, 2, 2, "hostfile"), tmp_path / "replaced", force=False)
    assert [parse_hostfile(p) for p in replaced] == [{"big": 2, "small": 2}]


def test_comments_blank_lines_and_indentation_are_ignored_in_a_plain_list(tmp_path):
    nodes = _node_list(tmp_path, "\ufeff# rack 1\n  node-a  \n\nnode-b # spare\n#node-c\n")
    assert read_nodes(nodes) == ({"node-a": None, "node-b": None}, False)


def test_duplicate_node_names_both_lines(tmp_path):
    nodes = _node_list(tmp_path, "node1\nnode2\n# c\nnode1\n")
    with pytest.raises(SplitError, match=r"nodes.txt:4: node node1 is already listed on line 1"):
        read_nodes(nodes)


def test_duplicate_host_in_a_hostfile_names_both_lines(tmp_path):
    nodes = _node_list(tmp_path, "node1 slots=8\nnode1 slots=8\n")
    with pytest.raises(HostfileError, match=r"nodes.txt:2: .*already listed on line 1"):
        read_nodes(nodes)


def test_two_words_on_a_plain_line_is_an_error_naming_the_line(tmp_path):
    with pytest.raises(SplitError, match=r"nodes.txt:2: `node2 node3` holds 2 words; write one node name per line"):
        read_nodes(_node_list(tmp_path, "node1\nnode2 node3\n"))


def test_earlier_batch_files_are_refused_unless_force_which_removes_stale_ones(tmp_path):
    _split(tmp_path, 4, 1)
    with pytest.raises(SplitError, match=r"already holds 4 batch files .* add --force"):
        _split(tmp_path, 4, 2)
    hosts, _ = read_nodes(tmp_path / "nodes.txt")
    written = write_batches(plan_split(hosts, 2, None, "nodes.txt"), tmp_path / "hostfiles", force=True)
    assert sorted(p.name for p in (tmp_path / "hostfiles").iterdir()) == [p.name for p in written]
    assert len(written) == 2  # batch-003 and batch-004 of the first split are gone


# --- through the installed console script -------------------------------------------------


@pytest.mark.slow
def test_cli_writes_the_hostfiles_prints_them_and_names_the_leftover_nodes(tmp_path, zerotrain_cli):
    nodes = _node_list(tmp_path, "".join(f"gpu-{i:02d}\n" for i in range(1, 6)))
    proc = zerotrain_cli("bench", "split", nodes, "hostfiles", "--nodes-per-job", "2", "--slots", "8")
    assert proc.returncode == 0, proc.stderr
    out_dir = zerotrain_cli.cwd / "hostfiles"
    assert sorted(p.name for p in out_dir.iterdir()) == ["batch-001", "batch-002"]
    assert (out_dir / "batch-002").read_text() == "gpu-03 slots=8\ngpu-04 slots=8\n"
    assert "batch-001" in proc.stdout and "gpu-01 gpu-02" in proc.stdout
    assert "1 node left over, not written: gpu-05" in proc.stdout
    assert "--nodes-per-job 1 or 5" in proc.stdout


@pytest.mark.parametrize(
    ("text", "k", "message"),
    [
        ("", "1", "lists no nodes (it is empty or holds only comments)"),
        ("node1\nnode2\nnode1\n", "1", "nodes.txt:3: node node1 is already listed on line 1"),
        ("node1\nnode2\n", "0", "--nodes-per-job 0: a job needs at least 1 node"),
    ],
    ids=["empty", "duplicate", "k-zero"],
)
@pytest.mark.slow
def test_cli_bad_input_is_one_clear_message_and_exit_2(tmp_path, zerotrain_cli, text, k, message):
    nodes = _node_list(tmp_path, text)
    proc = zerotrain_cli("bench", "split", nodes, "out", "--nodes-per-job", k)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (zerotrain_cli.cwd / "out").exists()


# --- the same command in this process (the console script costs seconds per call) -----------


def _main(*args) -> int:
    from zerotrain.cli.main import main

    return main(["bench", "split", *map(str, args)])


@pytest.mark.parametrize(
    ("text", "k", "message"),
    [
        ("# only a comment\n\n", "1", "lists no nodes"),
        ("node1\nnode2\n", "-2", "--nodes-per-job -2: a job needs at least 1 node"),
        ("node1\nnode2\n", "3", "--nodes-per-job 3 is more than the 2 nodes"),
        ("node1\n", "1 --slots 0", "--slots 0: a node needs at least 1 slot"),
        ("node1\nnode2 slots=x\n", "1", "nodes.txt:2: `node2 slots=x`: the slot count `x` is not a whole number"),
    ],
    ids=["comments-only", "k-negative", "k-too-big", "slots-zero", "bad-hostfile-line"],
)
def test_bad_input_exits_2_with_the_message(tmp_path, capsys, text, k, message):
    nodes = _node_list(tmp_path, text)
    assert _main(nodes, tmp_path / "out", "--nodes-per-job", *k.split()) == 2
    assert message in capsys.readouterr().err


def test_missing_node_list_and_earlier_batches_are_clear_errors(tmp_path, capsys):
    assert _main(tmp_path / "missing.txt", tmp_path / "out", "--nodes-per-job", "1") == 2
    assert "missing.txt does not exist" in capsys.readouterr().err
    nodes = _node_list(tmp_path, "node1\n")
    assert _main(nodes, tmp_path / "out", "--nodes-per-job", "1") == 0
    assert _main(nodes, tmp_path / "out", "--nodes-per-job", "1") == 2
    assert "add --force" in capsys.readouterr().err
    assert _main(nodes, tmp_path / "out", "--nodes-per-job", "1", "--force") == 0
    assert "slots=1 per node: a plain node list gives no GPU count" in capsys.readouterr().out
