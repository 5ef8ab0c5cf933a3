"""`zerotrain bench runner` (being built)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `runner` to `zerotrain bench`."""
    parser = commands.add_parser("runner" if "runner" != "runner" else "run", help="(being built)")
    parser.set_defaults(handler=lambda args: 2)
