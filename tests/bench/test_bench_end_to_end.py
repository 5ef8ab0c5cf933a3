"""The cluster bring-up procedure end to end: split a node list, run a job on every batch at
once, report, and find the node that was slowed on purpose (docs/bench.md)."""

from __future__ import annotations

import pytest

import csv

from conftest import FIXTURES

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

NODES = ["127.0.0.31", "127.0.0.32", "127.0.0.33"]
SLOW = "127.0.0.32"


def test_a_node_slowed_on_purpose_is_named_as_the_suspect(make_ssh_nodes, zerotrain_cli, tmp_path):
    # The slow node's sshd makes every step of its job wait 0.4 s instead of 0.02 s: ~20x slower.
    cluster = make_ssh_nodes(NODES, set_env={SLOW: {"BENCH_STEP_DELAY": "0.4"}})
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("# the cluster\n" + "\n".join(NODES) + "\n")
    zerotrain_cli("bench", "split", nodes, tmp_path / "hostfiles", "--nodes-per-job", "1", check=True)

    run = tmp_path / "run"
    done = zerotrain_cli("bench", "run", tmp_path / "hostfiles", "--timeout", "120", "--out", run,
                         "--ssh_args", cluster.ssh_args, "--", str(FIXTURES / "scripts" / "bench_paced_job.py"),
                         timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = zerotrain_cli("bench", "report", run, "--threshold", "100", "--csv", tmp_path / "results.csv",
                           "--plot", tmp_path / "results.png")
    assert report.returncode == 1, report.stdout + report.stderr  # one job did not pass
    rows = {row["job"]: row for row in csv.DictReader((tmp_path / "results.csv").open())}
    verdicts = {row["nodes"]: row["verdict"] for row in rows.values()}
    assert verdicts == {"127.0.0.31": "pass", SLOW: "fail", "127.0.0.33": "pass"}, rows
    assert f"suspects: {SLOW}" in report.stdout
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
