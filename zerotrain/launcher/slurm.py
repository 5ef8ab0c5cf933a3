"""Slurm side of a multi-node launch: the allocation's hosts, and the ``srun`` line that starts the agents.

Inside an allocation (``salloc`` or an ``sbatch`` script) Slurm names the job's
nodes in ``SLURM_JOB_NODELIST`` as a compressed host list such as
``gpu[01-04,07],login2``. `expand_nodelist` spells that out in pure Python, so
no ``scontrol`` is needed on the launching machine.

`srun_argv` builds one job step with one task per node: each task is a node
agent, which starts that node's ranks itself and learns its node rank from
``SLURM_NODEID``. This mirrors DeepSpeed's Slurm runner (``launcher_args`` go to
``srun`` as they are; an ``--include``/``--exclude`` selection becomes
``--nodelist``), except that DeepSpeed's runner starts every rank as its own
``srun`` task.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Mapping, Sequence

from zerotrain.launcher.local import LaunchError

# Variables in which Slurm names the allocation's nodes; the second is the older spelling.
NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
# Refuse to spell out more hosts than this: a typo such as gpu[0-99999999] would otherwise
# fill memory. Slurm's own parser stops at 64K hosts a range too.
MAX_EXPANDED_HOSTS = 64 * 1024

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SlurmError(LaunchError):
    """A Slurm launch cannot be built: no allocation, or a malformed node list."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host name of a Slurm host list, in Slurm's order, zero padding kept.

    ``gpu[01-04,07]`` gives gpu01..gpu04 and gpu07; entries are separated by commas
    or white space (``a[1-2],b3 c``); a name may hold several bracket groups
    (``rack[1-2]-node[01-02]``), expanded as Slurm does: the last group varies
    fastest, then the others from the second-to-last back to the first.
    Raises SlurmError, naming the list and the part at fault, for an empty list,
    unbalanced or nested brackets, an empty item, a non-number, or a range whose
    end is below its start.
    """
    if not nodelist or not nodelist.strip():
        raise SlurmError(
            "the Slurm node list is empty: expected host names such as `gpu[01-04],login2`"
        )
    hosts: list[str] = []
    for entry in _top_level_entries(nodelist):
        hosts.extend(_expand_entry(nodelist, entry, room=MAX_EXPANDED_HOSTS - len(hosts)))
    return hosts


def slurm_hosts(environ: Mapping[str, str]) -> list[str]:
    """The hosts of the Slurm allocation this process runs in, from its environment.

    Raises SlurmError when the environment names no allocation, saying how to get one.
    """
    for name in NODELIST_VARIABLES:
        value = environ.get(name, "")
        if value.strip():
            return expand_nodelist(value)
    raise SlurmError(
        "not inside a Slurm allocation: neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set. "
        "The Slurm launcher runs on nodes Slurm has already given the job: get them first, "
        "e.g. `salloc --nodes=2` and run the same command in the shell it opens, "
        "or put the command in a batch script and submit it with `sbatch --nodes=2 script.sh`"
    )


def srun_argv(
    num_nodes: int,
    agent_argv: Sequence[str],
    *,
    nodelist: Sequence[str] | None = None,
    launcher_args: str = "",
    environ_names: Sequence[str] = (),
) -> list[str]:
    """The ``srun`` command that starts one copy of `agent_argv` on each of `num_nodes` nodes.

    `nodelist` pins the step to exactly those hosts (the hosts left by --include/--exclude);
    without it Slurm picks `num_nodes` nodes of the allocation. `launcher_args` is split as a
    shell would and placed after zerotrain's own options, so an option given there (say
    ``--kill-on-bad-exit=0`` or ``--cpus-per-task=32``) overrides or adds to them.
    The agents get the launching environment (``--export=ALL``) whatever the batch script's
    ``--export`` said. `environ_names` are the variables the agents cannot run without
    (MASTER_ADDR, ...): they are listed in that option after ALL, and an ``--export`` in
    `launcher_args` (which replaces ours, srun keeping the last) must still pass them.
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise SlurmError(f"the number of nodes for srun must be a whole number of at least 1, got {num_nodes!r}")
    if not agent_argv:
        raise SlurmError("no command given for srun to start on each node (the agent command line is empty)")
    argv = ["srun", f"--nodes={num_nodes}", "--ntasks-per-node=1", f"--ntasks={num_nodes}"]
    if nodelist is not None:
        argv.append(f"--nodelist={_nodelist_option(num_nodes, nodelist)}")
    # Without it srun lets the other agents run on when one exits with an error.
    argv.append("--kill-on-bad-exit=1")
    names = _export_names(environ_names)
    argv.append(",".join(["--export=ALL", *names]))
    user_args = _split_launcher_args(launcher_args)
    _check_user_export(user_args, names)
    argv.extend(user_args)
    argv.extend(agent_argv)
    return argv


def _top_level_entries(nodelist: str) -> list[str]:
    """`nodelist` cut at commas and white space outside brackets; empty pieces dropped, as Slurm does."""
    entries: list[str] = []
    current: list[str] = []
    open_at = -1  # index of the '[' we are inside, -1 when outside brackets
    for index, char in enumerate(nodelist):
        if char == "[":
            if open_at >= 0:
                raise SlurmError(
                    f"bad Slurm node list {nodelist!r}: a `[` at character {index + 1} opens inside the "
                    f"bracket opened at character {open_at + 1}; brackets cannot nest, close the first with `]`"
                )
            open_at = index
        elif char == "]":
            if open_at < 0:
                raise SlurmError(
                    f"bad Slurm node list {nodelist!r}: the `]` at character {index + 1} closes no `[`; "
                    "remove it or add the missing `[`"
                )
            open_at = -1
        elif open_at < 0 and (char == "," or char.isspace()):
            if current:
                entries.append("".join(current))
                current = []
            continue
        current.append(char)
    if open_at >= 0:
        raise SlurmError(
            f"bad Slurm node list {nodelist!r}: the `[` at character {open_at + 1} is never closed; "
            "add the missing `]`"
        )
    if current:
        entries.append("".join(current))
    if not entries:
        raise SlurmError(f"the Slurm node list {nodelist!r} names no host")
    return entries


def _expand_entry(nodelist: str, entry: str, *, room: int) -> list[str]:
    """The hosts of one top-level entry, e.g. ``rack[1-2]-node[01-02]``; at most `room` of them."""
    # re.split with a capture group alternates: literal, group, literal, ..., literal.
    pieces = re.split(r"\[([^\]]*)\]", entry)
    literals = pieces[0::2]
    groups = [_expand_group(nodelist, entry, body) for body in pieces[1::2]]
    count = 1
    for numbers in groups:
        count *= len(numbers)
    if count > room:
        raise SlurmError(
            f"bad Slurm node list {nodelist!r}: {entry!r} (with the entries before it) names more than "
            f"{MAX_EXPANDED_HOSTS} hosts; check the ranges for a typo"
        )
    if not groups:
        return [entry]
    # Slurm's loop order: the last group innermost, the others from the second-to-last outward.
    loop_order = [*range(len(groups) - 2, -1, -1), len(groups) - 1]
    hosts = []
    for combination in itertools.product(*(groups[g] for g in loop_order)):
        chosen = dict(zip(loop_order, combination))
        parts = [literals[0]]
        for g in range(len(groups)):
            parts += [chosen[g], literals[g + 1]]
        hosts.append("".join(parts))
    return hosts


def _expand_group(nodelist: str, entry: str, body: str) -> list[str]:
    """The numbers one bracket group stands for (``01-03,7`` gives 01, 02, 03, 7), as text."""
    numbers: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise SlurmError(
                f"bad Slurm node list {nodelist!r}: `[{body}]` in {entry!r} has an empty item; "
                "write numbers or ranges between the commas, e.g. `[1-4,7]`"
            )
        match = _ITEM.fullmatch(item)
        if match is None:
            raise SlurmError(
                f"bad Slurm node list {nodelist!r}: {item!r} in {entry!r} is neither a number nor a range "
                "LOW-HIGH of numbers, e.g. `01-04`"
            )
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise SlurmError(
                f"bad Slurm node list {nodelist!r}: the range {item!r} in {entry!r} ends below its start; "
                f"write the smaller number first, e.g. `{high_text}-{low_text}`"
            )
        if high - low >= MAX_EXPANDED_HOSTS:
            raise SlurmError(
                f"bad Slurm node list {nodelist!r}: the range {item!r} in {entry!r} names more than "
                f"{MAX_EXPANDED_HOSTS} hosts; check it for a typo"
            )
        # Slurm pads every number of a range to the width of its first number as written.
        width = len(low_text)
        numbers.extend(f"{n:0{width}d}" for n in range(low, high + 1))
    return numbers


def _nodelist_option(num_nodes: int, nodelist: Sequence[str]) -> str:
    """The value of ``--nodelist``: the hosts, checked, comma-separated."""
    hosts = list(nodelist)
    if len(hosts) != num_nodes:
        raise SlurmError(
            f"srun was asked for {num_nodes} node(s) but given {len(hosts)} host(s) to run on "
            f"({', '.join(hosts) or 'none'}); the node count must match the host list"
        )
    for host in hosts:
        if not host or any(char in host for char in ",[]") or any(char.isspace() for char in host):
            raise SlurmError(
                f"{host!r} is not a single host name for srun --nodelist: "
                "it must be non-empty, without commas, brackets or spaces"
            )
    repeated = sorted({host for host in hosts if hosts.count(host) > 1})
    if repeated:
        raise SlurmError(
            f"host(s) {', '.join(repeated)} appear more than once in the srun node list; "
            "each node runs one agent, so list every host once"
        )
    return ",".join(hosts)


def _export_names(environ_names: Sequence[str]) -> list[str]:
    """The variable names for ``--export``, checked, repeats dropped, order kept."""
    names: list[str] = []
    for name in environ_names:
        if not _VARIABLE_NAME.fullmatch(name):
            raise SlurmError(
                f"{name!r} is not an environment variable name srun can export: "
                "use letters, digits and underscores, not starting with a digit"
            )
        if name not in names:
            names.append(name)
    return names


def _check_user_export(user_args: Sequence[str], names: Sequence[str]) -> None:
    """Refuses a launcher ``--export`` that would keep `names` from the agents."""
    for index, arg in enumerate(user_args):
        if arg.startswith("--export="):
            value = arg.split("=", 1)[1]
        elif arg == "--export" and index + 1 < len(user_args):
            value = user_args[index + 1]
        else:
            continue
        exported = [item.split("=", 1)[0] for item in value.split(",")]
        if exported[0] == "ALL":
            continue
        missing = [name for name in names if name not in exported]
        if not missing:
            continue
        fix = (
            "leave --export out, or write `--export=ALL,...` with your additions"
            if value == "NONE"
            else f"start it with ALL (`--export=ALL,{value}`) or add the missing names to it"
        )
        raise SlurmError(
            f"the launcher argument `--export={value}` would keep {', '.join(missing)} from the node agents, "
            f"which need them; {fix}"
        )


def _split_launcher_args(launcher_args: str) -> list[str]:
    """`launcher_args` split as a POSIX shell would, or a SlurmError saying what is wrong."""
    try:
        return shlex.split(launcher_args)
    except ValueError as error:
        raise SlurmError(
            f"cannot split the launcher arguments {launcher_args!r} for srun ({error}); close the quote"
        ) from None
