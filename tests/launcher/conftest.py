"""Fixtures for the launcher tests: real sshd "nodes" on loopback addresses (see sshd_nodes.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from .sshd_nodes import INSTALL_HINT, SSHD, SshCluster, start_ssh_nodes, stop_ssh_nodes


def _require_sshd() -> None:
    # Not a skip: without sshd the multi-node launcher would go untested, silently.
    if not SSHD.is_file():
        pytest.fail(f"the launcher tests need {SSHD}: {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def ssh_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    """Two nodes, 127.0.0.2 (alias node1) and 127.0.0.3 (node2), shared by the whole session."""
    _require_sshd()
    cluster = start_ssh_nodes(tmp_path_factory.mktemp("ssh-nodes"), ["127.0.0.2", "127.0.0.3"])
    yield cluster
    stop_ssh_nodes(cluster)


@pytest.fixture
def make_ssh_nodes(tmp_path):
    """Factory: ``make_ssh_nodes(addresses, nofile_limit=..., set_env=...)`` starts nodes of
    the test's own (in tmp_path), all stopped when the test ends."""
    _require_sshd()
    clusters: list[SshCluster] = []

    def make(addresses: Sequence[str] = ("127.0.0.2",), **settings) -> SshCluster:
        cluster = start_ssh_nodes(tmp_path / f"ssh-nodes-{len(clusters)}", addresses, **settings)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        stop_ssh_nodes(cluster)
