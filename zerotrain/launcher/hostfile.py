"""Hostfiles and slot selection: which hosts a multi-node job runs on, and which GPUs on each.

The formats are DeepSpeed's, so an existing DeepSpeed setup works unchanged:

* A hostfile has one ``HOST slots=N`` line per machine (N = GPUs to use there);
  ``#`` starts a comment, blank lines are ignored. Host order is rank order.
* ``--include`` / ``--exclude`` take ``HOST[:SLOT,SLOT...][@HOST[:SLOT,...]...]``:
  a bare host means all its slots, ``worker-1:0,2`` means slots 0 and 2.
* ``--num_nodes N`` keeps the first N hosts, ``--num_gpus N`` the first N slots of each.

Where DeepSpeed raises a bare ``ValueError`` (or crashes later on an empty
selection), every problem here is a :class:`HostfileError` that says which
file and line or which flag is wrong, and how to write it instead.

A host name goes to ssh as an argument, so it must be a plain name or address:
one starting with '-' would be read as an ssh option (``-oProxyCommand=...``
runs a command here), and one holding shell or markup characters is no host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from zerotrain.launcher.local import LaunchError

DEFAULT_HOSTFILE = "/job/hostfile"
"""Where DeepSpeed (and so we) look for a hostfile when --hostfile is not given."""

_SLOTS_KEY = "slots="
_WHOLE_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only: int() would also take '٣' or '+3'
_EXAMPLE_LINE = "worker-1 slots=8"
_EXAMPLE_FILTER = "worker-0@worker-1:0,2"
# Hosts listed in an error before "and N more": enough to spot a typo, short enough to read.
_MAX_HOSTS_SHOWN = 8
# Letters, digits, '.', '-', '_' (names) and ':' (IPv6); never a leading '-' (an ssh option) or '.'.
_HOST_NAME = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9._:-]*")
MAX_HOST_NAME_LENGTH = 253
"""The longest DNS name; a longer "host" is not one."""
MAX_SLOTS = 1024
"""Slots one host may have: far above any machine's GPUs, and low enough that listing them is cheap."""
MAX_HOSTFILE_BYTES = 16 * 2**20
"""A hostfile larger than this is not one (a million hosts fit in less)."""
# Characters of a bad line or name quoted in an error: a 10 MB line must not become a 10 MB message.
_MAX_QUOTED = 80


class HostfileError(LaunchError):
    """A hostfile, --include/--exclude filter or --num_nodes/--num_gpus limit that cannot be used."""


# --------------------------------------------------------------------------- hostfile


def parse_hostfile_text(text: str, source: str) -> dict[str, int]:
    """Hosts and their slot counts, in file order, from hostfile `text`.

    `source` names the text in error messages (normally the file's path). Every
    bad line is reported at once, each as ``source:LINE``.
    """
    hosts: dict[str, int] = {}
    first_line_of: dict[str, int] = {}
    problems: list[str] = []
    for line_number, raw_line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        content = raw_line.split("#", 1)[0].strip()
        if not content:
            continue
        where = f"{source}:{line_number}: `{_quoted(raw_line.strip())}`"
        tokens = content.split()
        problem = _host_line_problem(tokens)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        host, slots = tokens[0], _bounded_int(tokens[1][len(_SLOTS_KEY):])
        if host in hosts:
            problems.append(
                f"{where}: host {host} is already listed on line {first_line_of[host]}; "
                f"keep one line per host, with the number of slots to use there."
            )
            continue
        hosts[host] = slots
        first_line_of[host] = line_number
    if len(problems) == 1:
        raise HostfileError(problems[0])
    if problems:
        raise HostfileError(f"{len(problems)} bad lines in hostfile {source}:\n  " + "\n  ".join(problems))
    if not hosts:
        raise HostfileError(
            f"{source}: the hostfile lists no hosts (it is empty or holds only comments); "
            f"add one line per machine, like `{_EXAMPLE_LINE}`."
        )
    return hosts


def _quoted(text: str) -> str:
    """`text` as shown in an error: control characters escaped, cut to _MAX_QUOTED characters."""
    shown = text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= _MAX_QUOTED else shown[:_MAX_QUOTED] + f"... ({len(text)} characters)"


def _bounded_int(digits: str) -> int:
    """The value of an ASCII digit string, capped at 10**18 (int() refuses strings of over 4300 digits)."""
    significant = digits.lstrip("0")
    return int(significant or "0") if len(significant) <= 18 else 10**18


def host_name_problem(host: str) -> str | None:
    """Why `host` cannot be a host name given to ssh (``None`` when it can)."""
    if len(host) > MAX_HOST_NAME_LENGTH:
        return f"the host name is {len(host)} characters long; host names have at most {MAX_HOST_NAME_LENGTH}"
    if host.startswith("-"):
        return (f"the host name `{_quoted(host)}` starts with '-', so ssh would read it as an option, "
                f"not a host")
    if not _HOST_NAME.fullmatch(host):
        bad = sorted({c for c in host if not (c.isascii() and (c.isalnum() or c in "._:-"))})
        shown = " ".join(repr(c) for c in bad[:8]) or "a leading '.'"
        return f"the host name `{_quoted(host)}` holds {shown}, which no host name can"
    return None


def _host_line_problem(tokens: list[str]) -> str | None:
    """What is wrong with a hostfile line split into `tokens` (``None`` when it is fine)."""
    host = tokens[0]
    if host.startswith(_SLOTS_KEY):
        return f"the line has no host name before `{host}`; write it as `HOSTNAME {host}`, e.g. `{_EXAMPLE_LINE}`."
    bad_name = host_name_problem(host)
    if bad_name:
        return (
            f"{bad_name}: write the machine's name or address (letters, digits, '.', '-', '_', ':'), "
            f"or give it a short alias with a Host entry in ~/.ssh/config."
        )
    # What the user most likely meant, for the fix we suggest.
    slot_text = _intended_slot_count(tokens[1:])
    fix = f"write it as `{host} slots={slot_text or 'N'}`" + (
        "" if slot_text else f" (N = GPUs to use on {host}, e.g. `{host} slots=8`)"
    )
    if len(tokens) == 1:
        return f"missing the slot count; {fix}."
    if len(tokens) > 2:
        if slot_text:
            return f"`slots=N` takes no spaces around '='; {fix}."
        return (
            f"expected `HOST slots=N` and nothing more, found {len(tokens)} words; one host per line "
            f"(put comments after #), e.g. `{_EXAMPLE_LINE}`."
        )
    setting = tokens[1]
    if not setting.startswith(_SLOTS_KEY):
        return f"expected `slots=N` after the host name, found `{setting}`; {fix}."
    count = setting[len(_SLOTS_KEY):]
    if not _WHOLE_NUMBER.fullmatch(count):
        return f"the slot count `{_quoted(count)}` is not a whole number; {fix}."
    if _bounded_int(count) < 1:
        return (
            f"a host needs at least 1 slot, this one has {int(count)}; give it slots=1 or more, "
            f"or comment the line out with # to leave {host} out of the job."
        )
    if _bounded_int(count) > MAX_SLOTS:
        return (
            f"the slot count `{_quoted(count)}` is more than the {MAX_SLOTS} a host may have; slots are the "
            f"GPUs (or processes) to use on {host}: write the real number, e.g. `{host} slots=8`."
        )
    return None


def _intended_slot_count(words: list[str]) -> str | None:
    """The number in `slots = 8`, `slots =8`, `slots= 8`, `slots=8` or a bare `8`, if that is what `words` are."""
    joined = "".join(words)
    if joined.startswith(_SLOTS_KEY):
        joined = joined[len(_SLOTS_KEY):]
    elif len(words) != 1:
        return None
    return joined if _WHOLE_NUMBER.fullmatch(joined) and 0 < _bounded_int(joined) <= MAX_SLOTS else None


def parse_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Hosts and slot counts, in file order, from the hostfile at `path`."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_HOSTFILE_BYTES + 1)  # bounded: a huge or endless file is refused, not read
        if len(data) > MAX_HOSTFILE_BYTES:
            raise HostfileError(
                f"hostfile {os.fspath(path)} is larger than {MAX_HOSTFILE_BYTES // 2**20} MiB, which no list of "
                f"hosts is; check the path given to --hostfile (it should hold `HOST slots=N` lines)."
            )
        # Line ends as text mode reads them: a lone \r ends a line too (so what follows it is a host line).
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except FileNotFoundError:
        raise HostfileError(f"hostfile {os.fspath(path)} does not exist; check the path given to --hostfile.") from None
    except OSError as err:
        raise HostfileError(
            f"cannot read hostfile {os.fspath(path)}: {err.strerror or err}; check the path given to --hostfile "
            f"and that it is a readable file."
        ) from None
    except UnicodeDecodeError as err:
        raise HostfileError(
            f"hostfile {os.fspath(path)} is not UTF-8 text (byte {err.start} cannot be decoded); "
            f"it should hold plain `HOST slots=N` lines."
        ) from None
    return parse_hostfile_text(text, os.fspath(path))


# --------------------------------------------------------------------------- --include / --exclude


def select_slots(
    hosts: Mapping[str, int], include: str = "", exclude: str = "", *, source: str = ""
) -> dict[str, list[int]]:
    """The slots to run on: every slot of `hosts` (host -> slot count), narrowed by --include or --exclude.

    Hosts keep `hosts`' order and slots are sorted, so ranks follow the hostfile.
    Naming a slot or host twice in one filter is harmless (DeepSpeed allows it).
    `source` names where `hosts` came from in error messages: the hostfile's path,
    or e.g. ``SLURM_JOB_NODELIST``.
    """
    where = source or "the hostfile"
    if include and exclude:
        raise HostfileError(
            f"--include {include!r} and --exclude {exclude!r} cannot be used together; use --include alone to "
            f"name exactly the slots to run on, or --exclude alone to run on everything but the slots it names."
        )
    available = {host: list(range(count)) for host, count in hosts.items()}
    if not available:
        raise HostfileError(f"{where} lists no hosts, so there is nothing to run on.")
    if not include and not exclude:
        return available

    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    named = _parse_filter(flag, spec)
    for host, slots in named.items():
        _check_exists(flag, spec, host, slots, hosts, where)

    selection: dict[str, list[int]] = {}
    for host, all_slots in available.items():
        if host in named:
            chosen = set(all_slots) if named[host] is None else named[host]
            keep = sorted(chosen) if include else [slot for slot in all_slots if slot not in chosen]
        else:
            keep = [] if include else all_slots
        if keep:
            selection[host] = keep
    if not selection:
        # Only --exclude can get here: every --include entry names at least one existing slot.
        raise HostfileError(
            f"--exclude {spec!r} removes every slot of every host in {where}, leaving nothing to run on; "
            f"exclude fewer hosts or slots, or use --include to say what to run on."
        )
    return selection


def _parse_filter(flag: str, spec: str) -> dict[str, set[int] | None]:
    """Host -> slots named in an --include/--exclude `spec` (``None``: the whole host), in spec order."""
    named: dict[str, set[int] | None] = {}

    def fail(problem: str, *, show_grammar: bool = True) -> HostfileError:
        grammar = (
            f" Write hosts separated by '@', each optionally followed by ':' and comma-separated slot numbers, "
            f"e.g. {flag} {_EXAMPLE_FILTER}"
        )
        shown = repr(spec) if len(spec) <= _MAX_QUOTED else f"{spec[:_MAX_QUOTED]!r}... ({len(spec)} characters)"
        return HostfileError(f"{flag} {shown}: {problem}." + (grammar if show_grammar else ""))

    for entry in spec.split("@"):
        entry = entry.strip()
        if not entry:
            raise fail("empty host entry (check for a doubled, leading or trailing '@')")
        host, colon, slot_list = (part.strip() for part in entry.partition(":"))
        if not host:
            raise fail(f"no host name before ':' in {entry!r}")
        slots: set[int] | None = None
        if colon:
            if ":" in slot_list:
                raise fail(
                    f"more than one ':' in {entry!r}; list slots with commas, like {host}:0,1", show_grammar=False
                )
            slots = set()
            for item in slot_list.split(","):
                item = item.strip()
                if not item:
                    raise fail(f"empty slot number in {entry!r}")
                if not _WHOLE_NUMBER.fullmatch(item):
                    raise fail(f"slot {item[:_MAX_QUOTED]!r} on {host} is not a whole number; slots are GPU indices "
                               f"such as 0 or 3")
                if _bounded_int(item) >= MAX_SLOTS:
                    raise fail(f"slot {_quoted(item)} on {host} is past the {MAX_SLOTS} slots a host may have; "
                               f"slots are GPU indices such as 0 or 3")
                slots.add(int(item))
        if host in named and (named[host] is None) != (slots is None):
            # DeepSpeed silently keeps only the listed slots here; say so instead of guessing.
            raise fail(
                f"{host} is named both on its own (all slots) and with a slot list; name it once, either as "
                f"{host} for all its slots or as {host}:SLOT,SLOT for some",
                show_grammar=False,
            )
        if slots is None:
            named[host] = None
        else:
            named[host] = (named.get(host) or set()) | slots
    return named


def _check_exists(
    flag: str, spec: str, host: str, slots: set[int] | None, hosts: Mapping[str, int], where: str
) -> None:
    if host not in hosts:
        raise HostfileError(
            f"{flag} {spec!r} names host {host!r}, which is not in {where} (hosts there: "
            f"{_host_list(hosts)}); fix the spelling, or add a `{host} slots=N` line to the hostfile."
        )
    count = hosts[host]
    missing = sorted(slot for slot in (slots or ()) if slot >= count)
    if missing:
        valid = "slot 0 only" if count == 1 else f"slots 0..{count - 1}"
        names = ", ".join(str(slot) for slot in missing)
        raise HostfileError(
            f"{flag} {spec!r} names slot{'s' if len(missing) > 1 else ''} {names} on {host}, which has "
            f"{valid} (slots={count} in {where}); name only slots in that range, or raise {host}'s "
            f"slots= count if it really has more GPUs."
        )


def _host_list(hosts: Mapping[str, object]) -> str:
    names = list(hosts)
    shown = ", ".join(names[:_MAX_HOSTS_SHOWN])
    return shown + (f" and {len(names) - _MAX_HOSTS_SHOWN} more" if len(names) > _MAX_HOSTS_SHOWN else "")


# --------------------------------------------------------------------------- --num_nodes / --num_gpus


def limit_selection(
    selection: Mapping[str, list[int]], num_nodes: int = -1, num_gpus: int = -1
) -> dict[str, list[int]]:
    """`selection` cut to its first `num_nodes` hosts and the first `num_gpus` slots of each (-1: no limit).

    Asking for more hosts or slots than the selection has is an error, not a
    silent shortfall: the job would otherwise run with a different world size.
    """
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus", num_gpus)):
        if value != -1 and value < 1:
            raise HostfileError(f"{flag} {value}: must be 1 or more (or left out to use all).")
    limited = {host: list(slots) for host, slots in selection.items()}
    if num_nodes != -1:
        if num_nodes > len(limited):
            raise HostfileError(
                f"--num_nodes {num_nodes} asks for more hosts than there are: the selection has {len(limited)} "
                f"({_host_list(limited)}); ask for {len(limited)} or fewer, or add hosts to the hostfile."
            )
        limited = dict(list(limited.items())[:num_nodes])
    if num_gpus != -1:
        short = {host: len(slots) for host, slots in limited.items() if len(slots) < num_gpus}
        if short:
            counts = ", ".join(f"{host} has {count}" for host, count in short.items())
            fewest = min(short.values())
            raise HostfileError(
                f"--num_gpus {num_gpus} asks for more slots per host than some hosts have ({counts}); "
                f"ask for {fewest} or fewer, or take those hosts out of the hostfile."
            )
        limited = {host: slots[:num_gpus] for host, slots in limited.items()}
    return limited
