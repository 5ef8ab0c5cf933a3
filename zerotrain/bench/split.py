"""`zerotrain bench split` (being built)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `split` to `zerotrain bench`."""
    parser = commands.add_parser("split" if "split" != "runner" else "run", help="(being built)")
    parser.set_defaults(handler=lambda args: 2)
