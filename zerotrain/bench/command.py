"""The `zerotrain bench` command group: each subcommand's parser lives beside its code."""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from zerotrain.bench import comm, compute, report, runner, split

    bench = subparsers.add_parser(
        "bench",
        help="benchmark a cluster in batches of nodes and find the slow ones",
        description="Split a node list into hostfiles, run a job on each at once, report throughput and "
        "suspect nodes, and measure collective bandwidth. See docs/bench.md.",
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="COMMAND", required=True)
    split.add_parser(commands)
    runner.add_parser(commands)
    report.add_parser(commands)
    comm.add_parser(commands)
    compute.add_parser(commands)
