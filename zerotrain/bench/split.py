"""`zerotrain bench split`: a node list cut into hostfiles of K nodes each, one per benchmark job.

The input is either a plain node list (one host per line) or a DeepSpeed hostfile
(``host slots=N`` lines); ``#`` starts a comment and blank lines are ignored in both.
The output folder gets ``batch-001``, ``batch-002``, ... in node order, each a hostfile
of K ``host slots=N`` lines. Nodes left over when the count is not a multiple of K are
named, not written: a smaller job would not be comparable with the others.

A plain list says nothing about GPUs, so its nodes get ``slots=1`` (one process per
node, which runs anywhere) unless ``--slots N`` says how many to use; a hostfile keeps
its own slot counts unless ``--slots`` replaces them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zerotrain.launcher.hostfile import HostfileError, parse_hostfile_text

BATCH_PREFIX = "batch-"
PLAIN_LIST_SLOTS = 1
"""Slots per node for a plain node list without --slots (see the module docstring)."""


class SplitError(HostfileError):
    """A node list, flag or output folder that `bench split` cannot use; the message says the fix."""


@dataclass(frozen=True)
class SplitPlan:
    """The hostfiles to write: `batches[i]` is the (host, slots) list of batch i+1, in node order."""

    batches: list[list[tuple[str, int]]]
    leftover: list[str]
    """Nodes after the last whole batch, not written."""
    node_count: int


def read_nodes(path: Path) -> tuple[dict[str, int | None], bool]:
    """Hosts in file order with their slot counts (None for a plain list), and whether it was a hostfile."""
    source = os.fspath(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SplitError(f"node list {source} does not exist; give the file with one node per line.") from None
    except IsADirectoryError:
        raise SplitError(f"{source} is a folder; give the node list file (one node per line).") from None
    except UnicodeDecodeError as err:
        raise SplitError(f"{source} is not UTF-8 text (byte {err.start}); it should list one node per line.") from None
    except OSError as err:
        raise SplitError(f"cannot read node list {source}: {err.strerror or err}.") from None
    lines = [(n, raw.split("#", 1)[0].strip()) for n, raw in enumerate(text.removeprefix("\ufeff").split("\n"), 1)]
    lines = [(n, content) for n, content in lines if content]
    if not lines:
        raise SplitError(f"{source} lists no nodes (it is empty or holds only comments); "
                         f"write one node per line, e.g. `worker-1`, or `worker-1 slots=8` as in a hostfile.")
    if any("slots=" in content for _, content in lines):
        return dict(parse_hostfile_text(text, source)), True  # its messages name the line and the fix
    hosts: dict[str, int | None] = {}
    first_line: dict[str, int] = {}
    for number, content in lines:
        words = content.split()
        if len(words) > 1:
            raise SplitError(f"{source}:{number}: `{content}` holds {len(words)} words; write one node name per "
                             f"line (a hostfile line is `{words[0]} slots=N`).")
        host = words[0]
        if host in hosts:
            raise SplitError(f"{source}:{number}: node {host} is already listed on line {first_line[host]}; "
                             f"list each node once, or it would run two jobs at the same time.")
        hosts[host], first_line[host] = None, number
    return hosts, False


def check_flags(nodes_per_job: int, slots: int | None) -> None:
    """SplitError for a --nodes-per-job or --slots below 1 (checked before the file is read)."""
    if nodes_per_job < 1:
        raise SplitError(f"--nodes-per-job {nodes_per_job}: a job needs at least 1 node; give 1 or more.")
    if slots is not None and slots < 1:
        raise SplitError(f"--slots {slots}: a node needs at least 1 slot; give the GPUs to use per node, e.g. 8.")


def plan_split(hosts: dict[str, int | None], nodes_per_job: int, slots: int | None, source: str) -> SplitPlan:
    """Batches of `nodes_per_job` hosts in order; `slots` replaces every count when given."""
    check_flags(nodes_per_job, slots)
    if nodes_per_job > len(hosts):
        raise SplitError(f"--nodes-per-job {nodes_per_job} is more than the {len(hosts)} node"
                         f"{'s' if len(hosts) != 1 else ''} in {source}; give {len(hosts)} or fewer.")
    entries = [(host, slots or count or PLAIN_LIST_SLOTS) for host, count in hosts.items()]
    whole = len(entries) - len(entries) % nodes_per_job
    batches = [entries[i:i + nodes_per_job] for i in range(0, whole, nodes_per_job)]
    return SplitPlan(batches, [host for host, _ in entries[whole:]], len(entries))


def batch_name(index: int, count: int) -> str:
    """`batch-001`: numbered from 1, zero-padded so names sort in node order."""
    return f"{BATCH_PREFIX}{index:0{max(3, len(str(count)))}d}"


def write_batches(plan: SplitPlan, out_dir: Path, force: bool) -> list[Path]:
    """Writes the plan's hostfiles; earlier batch files in `out_dir` are an error unless `force` removes them."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SplitError(f"output folder {out_dir} is a file; give a folder for the hostfiles.")
    earlier = sorted(out_dir.glob(f"{BATCH_PREFIX}*")) if out_dir.is_dir() else []
    if earlier and not force:
        raise SplitError(f"{out_dir} already holds {len(earlier)} batch file{'s' if len(earlier) > 1 else ''} "
                         f"({earlier[0].name}{' ...' if len(earlier) > 1 else ''}) from an earlier split; "
                         f"give an empty folder, or add --force to replace them.")
    for path in earlier:  # --force: no stale batch-00N may survive to be run with the new ones
        if path.is_file():
            path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index, batch in enumerate(plan.batches, 1):
        path = out_dir / batch_name(index, len(plan.batches))
        path.write_text("".join(f"{host} slots={count}\n" for host, count in batch))
        written.append(path)
    return written


def leftover_note(plan: SplitPlan, nodes_per_job: int) -> str:
    """Which nodes were not written, and the --nodes-per-job values that would include them."""
    names = ", ".join(plan.leftover)
    even = [k for k in range(1, plan.node_count + 1) if plan.node_count % k == 0 and k != nodes_per_job]
    nearest = sorted(sorted(even, key=lambda k: abs(k - nodes_per_job))[:3])
    fits = " or ".join(str(k) for k in nearest)
    several = len(plan.leftover) > 1
    return (f"{len(plan.leftover)} node{'s' if several else ''} left over, not written: {names} "
            f"({plan.node_count} nodes do not split evenly into jobs of {nodes_per_job}). To include "
            f"{'them' if several else 'it'}, use --nodes-per-job {fits} (divides {plan.node_count} evenly), "
            f"or list {'them' if several else 'it'} in a file of {'their' if several else 'its'} own and split "
            f"that.")


def run_split(args: argparse.Namespace) -> int:
    """`zerotrain bench split`: writes the hostfiles and prints them as a table; 2 on a bad input."""
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error

    try:
        check_flags(args.nodes_per_job, args.slots)
        hosts, was_hostfile = read_nodes(Path(args.nodes))
        plan = plan_split(hosts, args.nodes_per_job, args.slots, args.nodes)
        written = write_batches(plan, Path(args.out_dir), args.force)
    except HostfileError as error:
        print_user_error("zerotrain bench split", error)
        return USAGE_EXIT_CODE
    console = Console(soft_wrap=True)
    files = f"{len(written)} hostfile{'s' if len(written) > 1 else ''}"
    table = Table(title=f"{files} of {args.nodes_per_job} node{'s' if args.nodes_per_job > 1 else ''}")
    table.add_column("hostfile")
    table.add_column("nodes")
    table.add_column("slots", justify="right")
    for path, batch in zip(written, plan.batches):
        counts = sorted({count for _, count in batch})
        table.add_row(escape(str(path)), escape(" ".join(host for host, _ in batch)), ",".join(map(str, counts)))
    console.print(table)
    if not was_hostfile and args.slots is None:
        console.print(f"slots={PLAIN_LIST_SLOTS} per node: a plain node list gives no GPU count; "
                      f"add --slots N to use N GPUs per node.", highlight=False)
    if plan.leftover:
        console.print(f"[yellow]{escape(leftover_note(plan, args.nodes_per_job))}[/]", highlight=False)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `split` to `zerotrain bench`."""
    parser = commands.add_parser(
        "split", help="cut a node list into hostfiles of K nodes each",
        description="Write OUT_DIR/batch-001, batch-002, ...: hostfiles of K nodes each, in the order of "
        "NODES (a plain list, one node per line, or a DeepSpeed hostfile). Nodes left over are named, "
        "not written.",
    )
    parser.add_argument("nodes", metavar="NODES", help="node list (one host per line) or hostfile (host slots=N)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder for the hostfiles")
    parser.add_argument("--nodes-per-job", "--nodes_per_job", dest="nodes_per_job", type=int, required=True,
                        metavar="K", help="nodes in each hostfile")
    parser.add_argument("--slots", type=int, default=None, metavar="N",
                        help=f"slots (GPUs) per node; default: the hostfile's, or {PLAIN_LIST_SLOTS} for a plain list")
    parser.add_argument("--force", action="store_true", help="replace batch files left in OUT_DIR by an earlier split")
    parser.set_defaults(handler=run_split)
