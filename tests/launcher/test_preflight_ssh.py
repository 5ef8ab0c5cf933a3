"""Pre-flight checks of `zerotrain launch` over real ssh: the whole round trip against sshd
on 127.0.0.2/3 (tests/launcher/sshd_nodes.py)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from zerotrain.launcher.node_plan import Node
from zerotrain.launcher.preflight import COLUMNS, PreflightRequest, run_preflight
from zerotrain.launcher.ssh import SshOptions

from .preflight_fixtures import cell, free_port


def ssh_request(cluster, tmp_path: Path, *, nodes=None, ssh_config=None, port=None, target="train.py",
                python=sys.executable, cwd=None) -> PreflightRequest:
    nodes = nodes or [Node(address, (0, 1), rank, 2 * rank) for rank, address in enumerate(cluster.addresses)]
    return PreflightRequest(
        nodes=nodes, python=python, cwd=str(cwd or tmp_path), target=target, target_kind="script",
        master_addr=nodes[0].host, master_port=port or free_port(), world_size=2 * len(nodes),
        ssh=SshOptions(extra_args=("-F", str(ssh_config or cluster.ssh_config))),
    )


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def test_two_good_nodes_pass_in_one_quick_round_trip(ssh_cluster, workdir):
    start = time.monotonic()
    report = run_preflight(ssh_request(ssh_cluster, workdir), timeout_s=180)
    # Node 0 stops listening as soon as node 1 has reached it, far inside its 90 s window.
    assert time.monotonic() - start < 45
    assert report.ok, report.failures()
    version = "%d.%d.%d" % sys.version_info[:3]
    for row_ in report.nodes:
        checks = row_.checks
        # ulimit -n may warn on this machine (below 65536); nothing else may.
        assert all(checks[k].status == "ok" for k in COLUMNS if k != "nofile"), checks
        assert checks["python"].text == version
    assert cell(report, "127.0.0.3", "master_port").text.startswith("reached 127.0.0.2:")


def test_host_without_sshd_is_refused_and_named(ssh_cluster, workdir, tmp_path_factory):
    # A Host block sends 127.0.0.9 to a port nothing listens on; the cluster's own blocks still apply.
    config = tmp_path_factory.mktemp("cfg") / "ssh_config"
    config.write_text(f"Include {ssh_cluster.ssh_config}\n\nHost 127.0.0.9\n    Port {free_port()}\n")
    nodes = [Node("127.0.0.2", (0,), 0, 0), Node("127.0.0.9", (0,), 1, 1)]
    report = run_preflight(ssh_request(ssh_cluster, workdir, nodes=nodes, ssh_config=config), timeout_s=4)
    assert not report.ok
    assert cell(report, "127.0.0.9", "ssh").text == "ssh connection refused"
    failures = report.failures()
    assert len(failures) == 1 and failures[0].startswith("127.0.0.9: ssh connection refused; ssh to 127.0.0.9")
    assert cell(report, "127.0.0.2", "ssh").status == "ok"


def test_other_torch_on_one_node_fails_naming_both_versions(make_ssh_nodes, workdir, tmp_path_factory):
    import importlib.metadata

    fake = tmp_path_factory.mktemp("fake-site")
    (fake / "torch-0.0.1.dist-info").mkdir()
    (fake / "torch-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n")
    cluster = make_ssh_nodes(["127.0.0.2", "127.0.0.3"], set_env={"127.0.0.3": {"PYTHONPATH": str(fake)}})
    report = run_preflight(ssh_request(cluster, workdir))
    ours = importlib.metadata.version("torch")
    assert report.failures() == [
        f"127.0.0.3: torch 0.0.1 here, {ours} on node 0 (127.0.0.2); pip install torch=={ours} into {sys.executable} "
        "on 127.0.0.3"
    ]


def test_busy_master_port_fails_on_node_0(ssh_cluster, workdir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen()
        port = holder.getsockname()[1]
        report = run_preflight(ssh_request(ssh_cluster, workdir, port=port))
    check = cell(report, "127.0.0.2", "master_port")
    assert check.status == "fail" and check.text.startswith(f"port {port} busy on 127.0.0.2")
    assert [line.split(";")[0] for line in report.failures()] == [f"127.0.0.2: {check.text}"]
    assert cell(report, "127.0.0.3", "master_port").text == "-"  # it reached the test's socket: meaningless


def test_low_open_files_limit_fails_on_that_node(make_ssh_nodes, workdir):
    cluster = make_ssh_nodes(["127.0.0.2", "127.0.0.3"], nofile_limit={"127.0.0.3": 256})
    report = run_preflight(ssh_request(cluster, workdir))
    check = cell(report, "127.0.0.3", "nofile")
    assert (check.status, check.text) == ("fail", "ulimit -n 256, below 1024 needed for 4 ranks")
    assert [line.split(";")[0] for line in report.failures()] == [f"127.0.0.3: {check.text}"]


def test_missing_script_cwd_and_python_fail_on_every_node(ssh_cluster, workdir):
    report = run_preflight(ssh_request(ssh_cluster, workdir, target="missing.py"))
    assert [line.split(";")[0] for line in report.failures()] == [
        f"{host}: script not found: missing.py (in {workdir})" for host in ssh_cluster.addresses
    ]
    report = run_preflight(ssh_request(ssh_cluster, workdir, cwd=workdir / "gone"))
    assert [line.split(";")[0] for line in report.failures()] == [
        f"{host}: cwd missing: {workdir / 'gone'}" for host in ssh_cluster.addresses
    ]
    report = run_preflight(ssh_request(ssh_cluster, workdir, python="/no/such/env/bin/python"))
    assert [line.split(";")[0] for line in report.failures()] == [
        f"{host}: python not found: /no/such/env/bin/python" for host in ssh_cluster.addresses
    ]
