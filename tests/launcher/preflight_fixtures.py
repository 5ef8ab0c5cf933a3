"""Helpers the test_preflight_*.py files share: a free local port, and a node's row or one cell
of a pre-flight report."""

from __future__ import annotations

from free_ports import free_port


def row(report, host):
    return next(r for r in report.nodes if r.node.host == host)


def cell(report, host, column):
    return row(report, host).checks[column]


