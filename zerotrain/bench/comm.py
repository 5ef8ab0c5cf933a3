"""`zerotrain bench comm` (being built)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `comm` to `zerotrain bench`."""
    parser = commands.add_parser("comm" if "comm" != "runner" else "run", help="(being built)")
    parser.set_defaults(handler=lambda args: 2)
