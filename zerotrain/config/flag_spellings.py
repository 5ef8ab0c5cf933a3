"""One spelling for the flags several commands share, with the other tools' spellings as aliases.

`estimate`, `plan`, `init`, `tune`, `train` and `launch` all ask how many GPUs each node has and
how many nodes there are. Each spells them `--gpus-per-node` and `--nodes` (in its help), and
each also takes what users bring from DeepSpeed (`--num_gpus`, `--num_nodes`), torchrun
(`--nproc_per_node`, `--nnodes`) and Accelerate (`--num_machines`), so a flag learned anywhere works everywhere.
"""

from __future__ import annotations

import argparse
from typing import Any

GPUS_PER_NODE = ("--gpus-per-node", "--num_gpus", "--nproc_per_node", "--gpus_per_node", "--num-gpus",
                 "--nproc-per-node", "--num_accelerators", "--gpus-per-machine")
"""Processes (GPUs) per node; the first is the one the help shows."""

NODES = ("--nodes", "--num_nodes", "--nnodes", "--num_machines", "--num-nodes", "--num-machines")
"""Nodes (machines); the first is the one the help shows."""


def add_shared_flag(parser: argparse.ArgumentParser, names: tuple[str, ...], **kwargs: Any) -> None:
    """Adds `names[0]` as the flag the help shows, and the other spellings as hidden aliases of it
    (same destination; the help line mentions the common ones)."""
    main, *aliases = names
    help_text = kwargs.pop("help", "")
    parser.add_argument(main, **kwargs, help=f"{help_text} (also {', '.join(aliases[:3])}, ...)" if help_text else None)
    hidden = {k: v for k, v in kwargs.items() if k in ("dest", "type", "metavar", "choices")}
    parser.add_argument(*aliases, **hidden, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
