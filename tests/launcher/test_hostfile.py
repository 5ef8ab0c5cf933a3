"""Hostfile parsing, --include/--exclude selection and --num_nodes/--num_gpus limits.

The valid and invalid cases DeepSpeed's launcher tests check are here too, so a
DeepSpeed hostfile or filter means the same thing to zerotrain; where zerotrain
differs (an error instead of an empty selection) the test says so.
"""

from __future__ import annotations

import re

import pytest

from zerotrain.launcher.hostfile import (
    DEFAULT_HOSTFILE,
    HostfileError,
    limit_selection,
    parse_hostfile,
    parse_hostfile_text,
    select_slots,
)
from zerotrain.launcher.local import LaunchError

TWO_HOSTS = {"worker-0": 4, "worker-1": 4}

# --------------------------------------------------------------------------- hostfile: valid


def test_default_hostfile_is_deepspeeds():
    assert DEFAULT_HOSTFILE == "/job/hostfile"


def test_hostfile_error_is_a_launch_error():
    assert issubclass(HostfileError, LaunchError)


def test_hostfile_with_blank_lines_comments_and_indentation_is_read_in_order():
    text = """
    worker-1 slots=2
    worker-2 slots=2

    localhost slots=1
    123.23.12.10 slots=2

    #worker-1 slots=3
    # this is a comment

    """
    hosts = parse_hostfile_text(text, "hf")
    assert hosts == {"worker-1": 2, "worker-2": 2, "localhost": 1, "123.23.12.10": 2}
    assert list(hosts) == ["worker-1", "worker-2", "localhost", "123.23.12.10"]


@pytest.mark.parametrize(
    "line",
    [
        "worker-1 slots=8",
        "worker-1 slots=8   # the big box",
        "worker-1 slots=8# no space before the comment",
        "\tworker-1\tslots=8\t",
        "worker-1 slots=08",
        "worker-1 slots=8\r",  # Windows line ending
    ],
)
def test_host_line_variants_are_accepted(line):
    assert parse_hostfile_text(line + "\n", "hf") == {"worker-1": 8}


def test_windows_line_endings_and_byte_order_mark_are_accepted():
    assert parse_hostfile_text("\ufeffa slots=1\r\nb slots=2\r\n", "hf") == {"a": 1, "b": 2}


def test_parse_hostfile_reads_the_file(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node-a slots=4\nnode-b slots=2\n")
    assert parse_hostfile(path) == {"node-a": 4, "node-b": 2}
    assert parse_hostfile(str(path)) == {"node-a": 4, "node-b": 2}


# --------------------------------------------------------------------------- hostfile: invalid


@pytest.mark.parametrize(
    ("line", "problem", "fix"),
    [
        ("missingslots", "missing the slot count", "`missingslots slots=N`"),
        ("slots=4", "no host name", "`HOSTNAME slots=4`"),
        ("worker-1 slots=eight", "`eight` is not a whole number", "`worker-1 slots=N`"),
        ("worker-1 slots=", "`` is not a whole number", "`worker-1 slots=N`"),
        ("worker-1 slots=-2", "`-2` is not a whole number", "`worker-1 slots=N`"),
        ("worker-1 slots=2.5", "`2.5` is not a whole number", "`worker-1 slots=N`"),
        ("worker-1 slots=0", "at least 1 slot", "comment the line out with #"),
        ("worker-1 8", "expected `slots=N` after the host name, found `8`", "`worker-1 slots=8`"),
        ("worker-1 max_slots=8", "found `max_slots=8`", "`worker-1 slots=N`"),
        ("worker-1 slots = 8", "no spaces", "`worker-1 slots=8`"),
        ("worker-1 slots =8", "no spaces", "`worker-1 slots=8`"),
        ("worker-1 slots=8 gpu", "nothing more, found 3 words", "`worker-1 slots=8`"),
        ("this is bad slots=1", "nothing more, found 4 words", "one host per line"),
        ("worker-1 slots=8 worker-2 slots=8", "found 4 words", "one host per line"),
    ],
)
def test_bad_host_line_names_file_line_quotes_it_and_says_the_fix(line, problem, fix):
    text = "# header\ngood slots=1\n" + line + "\n"
    with pytest.raises(HostfileError) as caught:
        parse_hostfile_text(text, "/etc/zt/hosts")
    message = str(caught.value)
    assert f"/etc/zt/hosts:3: `{line}`" in message
    assert problem in message
    assert fix in message


def test_duplicate_host_names_both_lines():
    text = "worker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1\n"
    with pytest.raises(HostfileError, match=r"hf:3: `worker-1 slots=1`: host worker-1 is already listed on line 1"):
        parse_hostfile_text(text, "hf")


def test_every_bad_line_is_reported_at_once():
    text = "worker-1 slots=2\nthis is bad slots=1\nworker-2 slots=4\nmissingslots\n\n"
    with pytest.raises(HostfileError) as caught:
        parse_hostfile_text(text, "hf")
    message = str(caught.value)
    assert message.startswith("2 bad lines in hostfile hf:")
    assert "hf:2: `this is bad slots=1`" in message
    assert "hf:4: `missingslots`" in message


@pytest.mark.parametrize("text", ["", "\n\n   \n", "# only\n  # comments\n"])
def test_hostfile_without_hosts_is_an_error(text):
    with pytest.raises(HostfileError, match=r"^hf: the hostfile lists no hosts .*`worker-1 slots=8`"):
        parse_hostfile_text(text, "hf")


def test_missing_hostfile_names_the_path(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(HostfileError, match=rf"hostfile {re.escape(str(path))} does not exist.*--hostfile"):
        parse_hostfile(path)


def test_unreadable_hostfile_names_the_path(tmp_path):
    with pytest.raises(HostfileError, match=rf"cannot read hostfile {re.escape(str(tmp_path))}: .*--hostfile"):
        parse_hostfile(tmp_path)  # a directory


def test_binary_hostfile_names_the_path(tmp_path):
    path = tmp_path / "hostfile"
    path.write_bytes(b"worker-1 slots=\xff\n")
    with pytest.raises(HostfileError, match=rf"hostfile {re.escape(str(path))} is not UTF-8 text"):
        parse_hostfile(path)


def test_bad_line_in_file_names_the_path_and_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=1\nb\n")
    with pytest.raises(HostfileError, match=rf"^{re.escape(str(path))}:2: `b`: missing the slot count"):
        parse_hostfile(path)


# --------------------------------------------------------------------------- selection: valid (DeepSpeed's cases)


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("", "", {"worker-0": [0, 1, 2, 3]}),
        ("", "worker-0:1", {"worker-0": [0, 2, 3]}),
        ("", "worker-0:1,2", {"worker-0": [0, 3]}),
        ("worker-0:1", "", {"worker-0": [1]}),
        ("worker-0:1,1", "", {"worker-0": [1]}),  # a slot named twice is harmless
        ("worker-0:1@worker-0:0,1", "", {"worker-0": [0, 1]}),  # so is a host named twice
        ("worker-0", "", {"worker-0": [0, 1, 2, 3]}),  # a bare host means all its slots
        ("worker-0:3,0,2", "", {"worker-0": [0, 2, 3]}),  # slots come back sorted
        ("", "worker-0:1@worker-0:1", {"worker-0": [0, 2, 3]}),
    ],
)
def test_one_host_selection(include, exclude, expected):
    assert select_slots({"worker-0": 4}, include, exclude) == expected


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ("worker-1:0,3", "", {"worker-1": [0, 3]}),
        ("worker-0", "", {"worker-0": [0, 1, 2, 3]}),
        ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("", "worker-1", {"worker-0": [0, 1, 2, 3]}),
        ("", "worker-0:1", {"worker-0": [0, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ("", "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
        ("", "worker-0:0,1,2,3", {"worker-1": [0, 1, 2, 3]}),  # a host with no slots left is dropped
        (" worker-0 @ worker-1 : 0 , 2 ", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),  # spaces ignored
    ],
)
def test_two_host_selection(include, exclude, expected):
    assert select_slots(TWO_HOSTS, include, exclude) == expected


def test_selection_keeps_hostfile_order_not_filter_order():
    hosts = {"c": 2, "a": 2, "b": 2}
    assert list(select_slots(hosts, include="b@a:1@c")) == ["c", "a", "b"]


def test_selection_does_not_change_its_input():
    hosts = dict(TWO_HOSTS)
    select_slots(hosts, exclude="worker-0")
    assert hosts == TWO_HOSTS


# --------------------------------------------------------------------------- selection: invalid


def test_include_and_exclude_together_is_an_error():
    with pytest.raises(HostfileError, match=r"--include 'A' and --exclude 'B' cannot be used together"):
        select_slots(TWO_HOSTS, include="A", exclude="B")


@pytest.mark.parametrize("flag", ["include", "exclude"])
@pytest.mark.parametrize("spec", ["jeff", "worker-0@jeff:0", "worker-1@worker-0:1@5"])
def test_unknown_host_names_flag_host_known_hosts_and_fix(flag, spec):
    with pytest.raises(HostfileError) as caught:
        select_slots(TWO_HOSTS, **{flag: spec}, source="/job/hostfile")
    message = str(caught.value)
    bad = "jeff" if "jeff" in spec else "5"
    assert message.startswith(f"--{flag} {spec!r} names host {bad!r}, which is not in /job/hostfile")
    assert "(hosts there: worker-0, worker-1)" in message
    assert f"add a `{bad} slots=N` line" in message


def test_unknown_host_lists_only_the_first_hosts_of_a_big_hostfile():
    hosts = {f"node-{i}": 8 for i in range(20)}
    with pytest.raises(HostfileError, match=r"node-7 and 12 more\)"):
        select_slots(hosts, include="node-99")


@pytest.mark.parametrize("flag", ["include", "exclude"])
@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("worker-0:4", "slot 4 on worker-0"),
        ("worker-0:99", "slot 99 on worker-0"),
        ("worker-0:0,4", "slot 4 on worker-0"),
        ("worker-0:7,0,4", "slots 4, 7 on worker-0"),
    ],
)
def test_unknown_slot_names_flag_slot_and_valid_range(flag, spec, names):
    with pytest.raises(HostfileError) as caught:
        select_slots({"worker-0": 4}, **{flag: spec}, source="hf")
    message = str(caught.value)
    assert message.startswith(f"--{flag} {spec!r} names {names}, which has slots 0..3 (slots=4 in hf)")
    assert "name only slots in that range" in message


def test_unknown_slot_on_one_slot_host_says_slot_0_only():
    with pytest.raises(HostfileError, match=r"names slot 1 on solo, which has slot 0 only"):
        select_slots({"solo": 1}, include="solo:1")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("worker-0@@worker-1", "empty host entry"),
        ("@worker-0", "empty host entry"),
        ("worker-0@", "empty host entry"),
        (":0", "no host name before ':'"),
        ("worker-0:", "empty slot number in 'worker-0:'"),
        ("worker-0:0,,1", "empty slot number"),
        ("worker-0:1,", "empty slot number"),
        ("worker-0:x", "slot 'x' on worker-0 is not a whole number"),
        ("worker-0:-1", "slot '-1' on worker-0 is not a whole number"),
        ("worker-0:1.0", "slot '1.0' on worker-0 is not a whole number"),
    ],
)
@pytest.mark.parametrize("flag", ["include", "exclude"])
def test_malformed_filter_names_flag_problem_and_grammar(flag, spec, problem):
    with pytest.raises(HostfileError) as caught:
        select_slots(TWO_HOSTS, **{flag: spec})
    message = str(caught.value)
    assert message.startswith(f"--{flag} {spec!r}: ")
    assert problem in message
    assert f"e.g. --{flag} worker-0@worker-1:0,2" in message


def test_more_than_one_colon_suggests_commas():
    with pytest.raises(HostfileError, match=r"--include 'worker-0:1:2': more than one ':'.*like worker-0:0,1"):
        select_slots(TWO_HOSTS, include="worker-0:1:2")


@pytest.mark.parametrize("spec", ["worker-0@worker-0:1", "worker-0:1@worker-0"])
def test_host_named_both_whole_and_with_slots_is_an_error(spec):
    # DeepSpeed quietly keeps only the listed slots here; we refuse to guess.
    with pytest.raises(HostfileError, match=r"worker-0 is named both on its own \(all slots\) and with a slot list"):
        select_slots(TWO_HOSTS, include=spec)


@pytest.mark.parametrize("spec", ["worker-0@worker-1", "worker-0:0,1,2,3@worker-1", "worker-1@worker-0:3,2,1,0"])
def test_excluding_everything_is_an_error(spec):
    # DeepSpeed returns an empty selection here and fails later; we say why now.
    with pytest.raises(HostfileError, match=r"--exclude .* removes every slot of every host .*exclude fewer"):
        select_slots(TWO_HOSTS, exclude=spec)


def test_no_hosts_is_an_error():
    with pytest.raises(HostfileError, match=r"^the hostfile lists no hosts"):
        select_slots({})
    with pytest.raises(HostfileError, match=r"^SLURM_JOB_NODELIST lists no hosts"):
        select_slots({}, source="SLURM_JOB_NODELIST")


def test_source_other_than_a_hostfile_is_named_as_given():
    with pytest.raises(HostfileError, match=r"names host 'n9', which is not in SLURM_JOB_NODELIST \(hosts there: n1\)"):
        select_slots({"n1": 1}, include="n9", source="SLURM_JOB_NODELIST")


def test_without_a_source_messages_say_the_hostfile():
    with pytest.raises(HostfileError, match=r"which is not in the hostfile \(hosts there"):
        select_slots({"n1": 1}, include="n9")


# --------------------------------------------------------------------------- --num_nodes / --num_gpus

THREE_HOSTS = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}


@pytest.mark.parametrize(
    ("num_nodes", "num_gpus", "expected"),
    [
        (-1, -1, THREE_HOSTS),
        (1, -1, {"a": [0, 1, 2, 3]}),
        (2, -1, {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}),
        (3, -1, THREE_HOSTS),
        (-1, 1, {"a": [0], "b": [0], "c": [0]}),
        (-1, 2, {"a": [0, 1], "b": [0, 1], "c": [0, 1]}),
        (2, 3, {"a": [0, 1, 2], "b": [0, 1, 2]}),  # host c is cut by --num_nodes first
        (1, 4, {"a": [0, 1, 2, 3]}),
    ],
)
def test_limits_keep_first_hosts_and_first_slots(num_nodes, num_gpus, expected):
    assert limit_selection(THREE_HOSTS, num_nodes, num_gpus) == expected


def test_num_gpus_keeps_the_first_selected_slots_not_slot_numbers():
    assert limit_selection({"a": [1, 3, 5]}, num_gpus=2) == {"a": [1, 3]}


def test_limits_do_not_change_their_input():
    selection = {"a": [0, 1], "b": [0, 1]}
    limit_selection(selection, 1, 1)
    assert selection == {"a": [0, 1], "b": [0, 1]}


def test_too_many_nodes_says_how_many_there_are():
    expected = r"--num_nodes 4 asks for more hosts .* has 3 \(a, b, c\); ask for 3 or fewer"
    with pytest.raises(HostfileError, match=expected):
        limit_selection(THREE_HOSTS, num_nodes=4)


def test_too_many_gpus_names_the_short_hosts():
    with pytest.raises(HostfileError, match=r"--num_gpus 3 asks for .* \(c has 2\); ask for 2 or fewer"):
        limit_selection(THREE_HOSTS, num_gpus=3)


def test_num_gpus_is_checked_only_against_hosts_kept_by_num_nodes():
    assert limit_selection(THREE_HOSTS, num_nodes=2, num_gpus=4) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}


@pytest.mark.parametrize(("num_nodes", "num_gpus", "flag"), [(0, -1, "--num_nodes 0"), (-1, 0, "--num_gpus 0"),
                                                              (-2, -1, "--num_nodes -2"), (-1, -5, "--num_gpus -5")])
def test_zero_or_negative_limits_are_errors(num_nodes, num_gpus, flag):
    with pytest.raises(HostfileError, match=rf"^{flag}: must be 1 or more"):
        limit_selection(THREE_HOSTS, num_nodes, num_gpus)
