"""Pre-flight checks of `zerotrain launch`: judging the probes' answers.

The tests feed made-up ssh results to `judge_preflight`, one rule at a time, and check
the table `render_preflight` makes of the report.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from rich.console import Console

from zerotrain.launcher.node_plan import Node
from zerotrain.launcher.preflight import (
    COLUMNS,
    PROBE_MARKER,
    PreflightRequest,
    judge_preflight,
    min_open_files,
    parse_probe_output,
    render_preflight,
)
from zerotrain.launcher.ssh import RUN_TIMEOUT_NOTE, SshOptions

from .preflight_fixtures import cell, row

PYTHON = "/opt/env/bin/python"
CWD = "/home/u/project"
NODES = [Node("node-a", (0, 1), 0, 0), Node("node-b", (0, 1), 1, 2)]
GOOD = {
    "python": "3.11.7",
    "executable": PYTHON,
    "hostname": "x",
    "cwd_exists": True,
    "target_present": True,
    "torch": "2.13.0",
    "zerotrain": "0.1.0",
    "gpus": 0,
    "nofile": [1024, 1048576],
    "memlock": [None, None],
}


def request(nodes=NODES, target="train.py", kind="script", world_size=4, port=29500) -> PreflightRequest:
    return PreflightRequest(
        nodes=nodes, python=PYTHON, cwd=CWD, target=target, target_kind=kind,
        master_addr="10.0.0.1", master_port=port, ssh=SshOptions(), world_size=world_size,
    )


def answer(node_rank: int, **changes) -> subprocess.CompletedProcess:
    port = {"role": "listen", "ok": True, "accepted": 1} if node_rank == 0 else {"role": "connect", "ok": True}
    facts = {**GOOD, "port": port, **changes}
    return subprocess.CompletedProcess([], 0, stdout=f"motd line\n{PROBE_MARKER}{json.dumps(facts)}\n", stderr="")


def judge(b=None, a=None, **kw):
    """Report for node-a (node 0) and node-b answering `a` and `b` (default: all good)."""
    return judge_preflight(request(**kw), {"node-a": a or answer(0), "node-b": b or answer(1)})


def test_all_good_answers_pass_with_every_column_ok():
    report = judge()
    assert report.ok and report.failures() == [] and report.warnings() == []
    assert [list(r.checks) for r in report.nodes] == [list(COLUMNS)] * 2
    assert {c.status for r in report.nodes for c in r.checks.values()} == {"ok"}
    assert cell(report, "node-a", "gpus").text == "CPU"
    assert cell(report, "node-a", "master_port").text == "listening on 29500"
    assert cell(report, "node-b", "master_port").text == "reached 10.0.0.1:29500"


def test_probe_answer_is_found_after_login_noise_and_bad_lines_are_none():
    assert parse_probe_output(f"hello\n{PROBE_MARKER}{{\"a\": 1}}\nbye\n") == {"a": 1}
    assert parse_probe_output("no answer\n") is None
    assert parse_probe_output(f"{PROBE_MARKER}{{cut") is None


@pytest.mark.parametrize(
    ("stderr", "text"),
    [
        ("ssh: connect to host node-b port 22: Connection refused", "ssh connection refused"),
        ("ssh: connect to host node-b port 22: Connection timed out", "ssh timed out"),
        ("u@node-b: Permission denied (publickey,password).", "ssh permission denied"),
        ("ssh: Could not resolve hostname node-b: Name or service not known", "ssh: unknown host name"),
        ("Host key verification failed.", "ssh: host key not accepted"),
        ("ssh: connect to host node-b port 22: No route to host", "ssh: host unreachable"),
        (f"{RUN_TIMEOUT_NOTE} 30 s: the command on node-b had not finished", "ssh timed out"),
    ],
)
def test_ssh_failure_fails_the_ssh_cell_by_host_and_skips_the_rest(stderr, text):
    report = judge(b=subprocess.CompletedProcess([], 255, stdout="", stderr=stderr + "\n"))
    assert not report.ok
    ssh = cell(report, "node-b", "ssh")
    # The fix is ssh.py's diagnosis, which names the host and what to do.
    assert (ssh.status, ssh.text) == ("fail", text) and ssh.fix.startswith("ssh to node-b")
    assert ssh.cell and len(ssh.cell) < len(text)
    assert {c.text for k, c in row(report, "node-b").checks.items() if k != "ssh"} == {"-"}
    assert report.failures() == [f"node-b: {text}; {ssh.fix}"]
    assert cell(report, "node-a", "ssh").status == "ok"


def test_missing_python_fails_naming_the_path_and_the_same_path_fix():
    stderr = f"bash: line 1: {PYTHON}: No such file or directory\n"
    missing = subprocess.CompletedProcess([], 127, stdout="", stderr=stderr)
    report = judge(b=missing)
    python = cell(report, "node-b", "python")
    assert python.status == "fail" and python.text == f"python not found: {PYTHON}"
    assert "same" in python.fix and "shared filesystem" in python.fix
    assert cell(report, "node-b", "ssh").status == "ok" and cell(report, "node-b", "torch").text == "-"
    assert report.failures() == [f"node-b: python not found: {PYTHON}; {python.fix}"]


def test_a_probe_that_crashes_fails_with_its_last_error_line():
    broken = subprocess.CompletedProcess([], 1, stdout="", stderr="Traceback...\nSyntaxError: invalid syntax\n")
    python = cell(judge(b=broken), "node-b", "python")
    assert python.status == "fail" and "SyntaxError: invalid syntax" in python.text and "node-b" in python.fix


def test_missing_cwd_fails_and_skips_the_target():
    report = judge(b=answer(1, cwd_exists=False, target_present=None))
    assert cell(report, "node-b", "cwd").status == "fail"
    assert cell(report, "node-b", "cwd").text == f"cwd missing: {CWD}"
    assert "shared filesystem" in cell(report, "node-b", "cwd").fix
    assert cell(report, "node-b", "target").text == "-"


@pytest.mark.parametrize(
    ("kind", "target", "text"),
    [
        ("script", "train.py", f"script not found: train.py (in {CWD})"),
        ("module", "pkg.train", f"module not found: pkg (in {CWD} or {PYTHON})"),
        ("program", "mytool", "program not found: mytool"),
    ],
)
def test_missing_target_fails_with_its_kind(kind, target, text):
    report = judge(b=answer(1, target_present=False), target=target, kind=kind)
    check = cell(report, "node-b", "target")
    assert (check.status, check.text) == ("fail", text) and check.fix
    assert cell(report, "node-a", "target").status == "ok"


@pytest.mark.parametrize("package", ["python", "torch", "zerotrain"])
def test_version_different_from_node_0_fails_naming_both(package):
    other = {"python": "3.10.2", "torch": "2.5.1", "zerotrain": "0.0.9"}[package]
    report = judge(b=answer(1, **{package: other}))
    check = cell(report, "node-b", package)
    assert check.status == "fail"
    assert check.text == f"{package} {other} here, {GOOD[package]} on node 0 (node-a)"
    assert check.cell == f"{other} != {GOOD[package]}"  # the table's short form
    assert cell(report, "node-a", package).status == "ok"
    if package != "python":
        assert f"{package}=={GOOD[package]}" in check.fix


def test_missing_torch_fails_with_install_fix():
    check = cell(judge(b=answer(1, torch=None)), "node-b", "torch")
    assert check.status == "fail" and check.text == "torch not installed" and PYTHON in check.fix


def test_versions_are_compared_with_the_first_node_that_answered_when_node_0_did_not():
    stderr = "ssh: connect to host node-a port 22: Connection refused\n"
    refused = subprocess.CompletedProcess([], 255, stdout="", stderr=stderr)
    nodes = [*NODES, Node("node-c", (0,), 2, 4)]
    report = judge_preflight(
        request(nodes=nodes), {"node-a": refused, "node-b": answer(1), "node-c": answer(2, torch="2.5.1")}
    )
    assert cell(report, "node-c", "torch").text == "torch 2.5.1 here, 2.13.0 on node-b"
    # Node 0 did not listen, so what the others found at MASTER_ADDR:PORT says nothing.
    assert cell(report, "node-b", "master_port").text == "-"


def test_gpu_node_with_fewer_gpus_than_slots_fails_and_cpu_node_is_ok():
    report = judge(b=answer(1, gpus=1))
    check = cell(report, "node-b", "gpus")
    assert check.status == "fail" and check.text == "1 GPU, slots 0,1 need 2" and "node-b" in check.fix
    assert cell(judge(b=answer(1, gpus=2)), "node-b", "gpus").text == "2"


def test_slot_index_beyond_the_gpus_fails():
    nodes = [NODES[0], Node("node-b", (2, 3), 1, 2)]
    check = cell(judge(b=answer(1, gpus=3), nodes=nodes), "node-b", "gpus")
    assert (check.status, check.text) == ("fail", "3 GPUs, slots 2,3 need 4")
    assert cell(judge(b=answer(1, gpus=4), nodes=nodes), "node-b", "gpus").status == "ok"


def test_min_open_files_grows_with_the_world_size():
    assert min_open_files(1) == 1024 and min_open_files(16) == 1024
    assert min_open_files(17) == 64 * 17 and min_open_files(2048) == 131072


def test_open_files_are_judged_by_the_hard_limit():
    # Soft 256 is fine: the node agent raises it to the hard limit.
    assert cell(judge(b=answer(1, nofile=[256, 1048576])), "node-b", "nofile").status == "ok"
    low = cell(judge(b=answer(1, nofile=[256, 256])), "node-b", "nofile")
    assert low.status == "fail" and low.text == "ulimit -n 256, below 1024 needed for 4 ranks"
    assert "ulimit -n 65536" in low.fix and "LimitNOFILE" in low.fix and "limits.conf" in low.fix
    # Below NCCL's recommendation: a warning on a GPU node, fine for Gloo on a CPU node.
    assert cell(judge(b=answer(1, nofile=[4096, 4096])), "node-b", "nofile").status == "ok"
    gpu_node = answer(1, nofile=[4096, 4096], gpus=8)
    warn = cell(judge(b=gpu_node), "node-b", "nofile")
    assert warn.status == "warn" and warn.text == "ulimit -n 4096, below 65536"
    report = judge(b=gpu_node)
    assert report.ok and f"node-b: ulimit -n 4096, below 65536; {warn.fix}" in report.warnings()


def test_open_files_minimum_for_a_large_job():
    check = cell(judge(b=answer(1, nofile=[65536, 65536]), world_size=2048), "node-b", "nofile")
    assert check.status == "fail" and "below 131072 needed for 2048 ranks" in check.text


def test_memlock_warns_on_gpu_nodes_only():
    gpu = cell(judge(b=answer(1, gpus=2, memlock=[65536, 65536])), "node-b", "memlock")
    assert gpu.status == "warn" and gpu.text == "ulimit -l 64 KiB, not unlimited" and "NCCL" in gpu.fix
    assert "memlock unlimited" in gpu.fix and "limits.conf" in gpu.fix
    cpu = cell(judge(b=answer(1, memlock=[65536, 65536])), "node-b", "memlock")
    assert (cpu.status, cpu.text) == ("ok", "64 KiB")
    assert cell(judge(b=answer(1, gpus=2)), "node-b", "memlock").text == "unlimited"


def test_busy_master_port_fails_on_node_0_and_skips_the_others():
    busy = answer(0, port={"role": "listen", "ok": False, "error": "Address already in use"})
    report = judge(a=busy)
    check = cell(report, "node-a", "master_port")
    assert check.status == "fail" and check.text.startswith("port 29500 busy on node-a") and check.cell == "busy"
    assert "--master_port" in check.fix
    assert cell(report, "node-b", "master_port").text == "-"


def test_privileged_master_port_fails_with_its_own_fix():
    denied = answer(0, port={"role": "listen", "ok": False, "error": "Permission denied"})
    check = cell(judge(a=denied, port=80), "node-a", "master_port")
    assert check.text == "port 80 not allowed on node-a (Permission denied)" and "above 1023" in check.fix


def test_unreachable_master_fails_on_the_node_that_cannot_reach_it():
    report = judge(b=answer(1, port={"role": "connect", "ok": False, "error": "Connection refused"}))
    check = cell(report, "node-b", "master_port")
    assert check.status == "fail"
    assert check.text == "cannot reach 10.0.0.1:29500 from node-b (Connection refused)"
    assert "firewall" in check.fix and "--master_addr" in check.fix


def test_master_addr_that_is_not_node_0_fails():
    foreign = {"role": "connect", "ok": False, "foreign": True, "error": "answered, but not by node 0"}
    check = cell(judge(b=answer(1, port=foreign)), "node-b", "master_port")
    assert check.status == "fail" and "is not node 0 (node-a)" in check.text and "--master_addr" in check.fix


def test_table_has_a_row_per_node_and_colours_failures_and_warnings():
    report = judge(b=answer(1, nofile=[256, 256], gpus=2, memlock=[65536, 65536]))
    table = render_preflight(report)
    assert table.row_count == 2 and len(table.columns) == 1 + len(COLUMNS)
    nofile_col = table.columns[1 + list(COLUMNS).index("nofile")]
    memlock_col = table.columns[1 + list(COLUMNS).index("memlock")]
    assert "red" in str(list(nofile_col.cells)[1].style) and "yellow" in str(list(memlock_col.cells)[1].style)
    console = Console(record=True, width=250)
    console.print(table)
    shown = console.export_text()
    assert "node-b" in shown and "ulimit -n" in shown and "256 < 1024" in shown and "64 KiB" in shown
