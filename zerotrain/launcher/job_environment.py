"""The environment variables every node of a multi-node job gets, whichever machine it runs on.

DeepSpeed's rules, so an existing setup carries over. Later sources win:

1. Variables of the launching shell whose names start with one of
   :data:`EXPORTED_PREFIXES` (``NCCL_DEBUG``, ``PYTHONPATH``, ...) or are in
   :data:`EXPORTED_NAMES`.
2. ``.deepspeed_env`` files: ``~/.deepspeed_env`` then ``./.deepspeed_env``.
   ``DS_ENV_FILE`` names a different file instead (looked up in the same two
   folders when it is a bare or relative name, as DeepSpeed does).
3. ``--env KEY=VALUE`` flags.

The files are read tolerantly, because tools such as Accelerate append the
whole of a shell's environment to them: lines that are not ``KEY=VALUE`` are
skipped with a warning, and variables that only make sense for one process or
one machine (:func:`is_process_specific`) are dropped with a warning.

Values are kept exactly as written (no ``$VAR`` expansion): the launcher sends
them to each node as JSON, never through a shell, so any character survives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from zerotrain.launcher.local import LaunchError

EXPORTED_PREFIXES: tuple[str, ...] = ("NCCL", "PYTHON", "MV2", "UCX", "GLOO_", "TORCH_", "ZEROTRAIN_")
"""Launching-shell variables whose names start with one of these go to every node."""
EXPORTED_NAMES: frozenset[str] = frozenset({"OMP_NUM_THREADS"})
"""Launching-shell variables with exactly these names go to every node."""
ENV_FILE_NAME = ".deepspeed_env"
"""The file, in the home folder and the current folder, that adds variables for every node."""
ENV_FILE_VARIABLE = "DS_ENV_FILE"
"""Names an env file to read instead of ``.deepspeed_env`` (DeepSpeed's variable)."""

# Variables a node must never inherit from the launching machine or an env file:
# the launcher (or torch's agent, MPI, Slurm, the shell) sets them per process or
# per machine, so one machine's value would be wrong, often silently, on the others.
DENIED_NAMES: frozenset[str] = frozenset({
    # Rank layout, set per worker by torch's elastic agent.
    "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
    # Rendezvous: chosen by the launcher (--master_addr / --master_port).
    "MASTER_ADDR", "MASTER_PORT",
    # GPU choice: the launcher gives each node the slots of its hostfile line.
    "CUDA_VISIBLE_DEVICES",
    # Describe the machine or shell the file was written on.
    "HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_",
})
DENIED_PREFIXES: tuple[str, ...] = (
    "TORCHELASTIC_",  # the agent's own per-run bookkeeping
    "SSH_",  # the ssh session of the machine the file was written on (SSH_CONNECTION, SSH_AUTH_SOCK, ...)
    "OMPI_COMM_WORLD_", "PMI_", "PMIX_",  # MPI's per-process rank variables
    "SLURM_",  # per-node and per-task job-step variables (SLURM_PROCID, SLURM_NODEID, ...)
)
# Where to choose what a denied --env variable would have set.
_DENIED_FLAG_HINTS = {
    "CUDA_VISIBLE_DEVICES": "choose GPUs with --include HOST:SLOT,SLOT, --exclude or --num_gpus",
    "MASTER_ADDR": "use --master_addr",
    "MASTER_PORT": "use --master_port",
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPORT = re.compile(r"export\s+")
# What a backslash means inside double quotes; any other backslash is kept as written.
_DOUBLE_QUOTE_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "$": "$"}
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, kept as surrogates by the reader
MAX_ENV_FILE_BYTES = 16 * 2**20
"""An env file larger than this is refused: no environment is that large, so it is the wrong file."""
MAX_VARIABLE_BYTES = 128 * 2**10
"""Linux's limit on one ``KEY=VALUE`` string of a new process (MAX_ARG_STRLEN): a longer variable
would make every rank fail to start ("Argument list too long"), so it is skipped with a warning."""


class EnvFileError(LaunchError):
    """An env file, DS_ENV_FILE or --env flag that cannot be used."""


def is_process_specific(name: str) -> bool:
    """Whether `name` is set per process or per machine, and so never passed to a whole job."""
    return name in DENIED_NAMES or name.startswith(DENIED_PREFIXES)


def is_exported(name: str) -> bool:
    """Whether the launching shell's variable `name` goes to every node."""
    return (name.startswith(EXPORTED_PREFIXES) or name in EXPORTED_NAMES) and not is_process_specific(name)


# --------------------------------------------------------------------------- env file parsing


def parse_env_file_text(text: str, source: str) -> tuple[dict[str, str], list[str]]:
    """The variables an env file sets, and warnings about lines it skipped or read oddly.

    Accepts ``KEY=VALUE`` and ``export KEY=VALUE`` lines, ``#`` comment lines,
    blank lines and Windows line endings. An unquoted value is everything after
    the first ``=`` exactly. A value in single quotes is literal; in double
    quotes, ``\\"``, ``\\\\``, ``\\n`` and ``\\$`` are escapes. A quoted value
    may be followed by a ``# comment``. A key set twice keeps its last value.
    Nothing here is refused: lines that cannot be read are skipped and warned
    about (consecutive ones in one warning), each naming ``source:LINE``.
    """
    values: dict[str, str] = {}
    warnings: list[str] = []
    skipped: list[tuple[int, str]] = []  # the current run of consecutive unreadable lines

    def flush_skipped() -> None:
        if skipped:
            warnings.append(_skipped_lines_warning(source, skipped))
            skipped.clear()

    # Not splitlines(): it also splits at characters such as \x1c or \u2028 that may sit inside a value.
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        line = line.removesuffix("\r")
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            flush_skipped()
            continue
        problem = _unreadable_line_problem(stripped)
        if problem:
            skipped.append((number, problem))
            continue
        flush_skipped()
        key, raw_value = _EXPORT.sub("", line.lstrip(), count=1).split("=", 1)
        value, warning = _unquote(raw_value, key)
        if warning:
            warnings.append(f"{source}:{number}: {warning}")
        size = len(f"{key}={value}".encode("utf-8", "surrogateescape")) + 1  # with its NUL, as the kernel counts
        if size > MAX_VARIABLE_BYTES:
            warnings.append(
                f"{source}:{number}: skipped {key}: it is {size} bytes long, more than the "
                f"{MAX_VARIABLE_BYTES // 2**10} KiB Linux allows one environment variable, so no rank could start "
                f"with it; shorten it, or pass the data in a file and its path in {key}."
            )
            continue
        values[key] = value
    flush_skipped()
    return values, warnings


def _unreadable_line_problem(stripped: str) -> str | None:
    """Why a non-blank, non-comment line cannot be read as ``KEY=VALUE`` (``None`` when it can)."""
    if _UNDECODABLE.search(stripped):
        return "it is not valid UTF-8 text"
    if "\0" in stripped:
        return "it holds a NUL character, which no environment variable can"
    body = _EXPORT.sub("", stripped, count=1)
    if "=" not in body:
        if _NAME.fullmatch(body):
            return f"`{body}` has no '=VALUE'; write {body}=VALUE (or {body}= for an empty value)"
        return "it has no '='"
    key = body.split("=", 1)[0]
    if key != key.rstrip():
        return f"spaces before '=' after `{key.strip()[:40]}`; write KEY=VALUE with no spaces around '='"
    if not _NAME.fullmatch(key):
        return f"`{key[:40]}` is not a variable name (letters, digits and _, not starting with a digit)"
    return None


def _skipped_lines_warning(source: str, skipped: list[tuple[int, str]]) -> str:
    first, problem = skipped[0]
    if len(skipped) == 1:
        return f"{source}:{first}: skipped a line that is not KEY=VALUE: {problem}."
    # Usually one value that spans several lines, written by a tool that dumped a whole environment.
    return (
        f"{source}:{first}-{skipped[-1][0]}: skipped {len(skipped)} lines that are not KEY=VALUE "
        f"(line {first}: {problem})."
    )


def _unquote(raw: str, key: str) -> tuple[str, str | None]:
    """The value `raw` (the text after ``=``) stands for, and a warning when its quoting looks broken."""
    if not raw or raw[0] not in "\"'":
        return raw, None
    quote = raw[0]
    chars: list[str] = []
    index = 1
    while index < len(raw):
        char = raw[index]
        if char == quote:
            rest = raw[index + 1:].strip()
            if rest and not rest.startswith("#"):
                return raw, (
                    f"{key}'s value has text after its closing {quote} quote, so it was kept exactly as "
                    f"written, quotes included; quote the whole value, or put a # before a comment."
                )
            return "".join(chars), None
        if quote == '"' and char == "\\" and index + 1 < len(raw) and raw[index + 1] in _DOUBLE_QUOTE_ESCAPES:
            chars.append(_DOUBLE_QUOTE_ESCAPES[raw[index + 1]])
            index += 2
            continue
        chars.append(char)
        index += 1
    return raw, (
        f"{key}'s value opens a {quote} quote that is not closed on the same line, so it was kept exactly as "
        f"written, quote included; close the quote (a value cannot span lines: write \\n inside double quotes)."
    )


# --------------------------------------------------------------------------- which files


def env_file_paths(environ: Mapping[str, str], cwd: str, home: str) -> list[Path]:
    """The env files to read, in order: existing ones only.

    Without DS_ENV_FILE: ``home/.deepspeed_env`` then ``cwd/.deepspeed_env``.
    With DS_ENV_FILE set to an absolute path (``~`` is `home`): that file; to a
    bare or relative name: that name in `home`, then in `cwd`. A DS_ENV_FILE
    that matches no file is an error, since the user asked for it explicitly.
    """
    named = environ.get(ENV_FILE_VARIABLE, "")
    name = named or ENV_FILE_NAME
    if name == "~" or name.startswith("~/"):
        name = home + name[1:]
    candidates = [Path(name)] if os.path.isabs(name) else [Path(home, name), Path(cwd, name)]
    found: list[Path] = []
    for path in candidates:
        if path.is_file() and not any(_same_file(path, seen) for seen in found):
            found.append(path)
    if named and not found:
        looked = " or ".join(str(path) for path in candidates)
        what = "is not a file" if len(candidates) == 1 and candidates[0].exists() else "does not exist"
        raise EnvFileError(
            f"{ENV_FILE_VARIABLE}={named} names an env file, but {looked} {what}; point {ENV_FILE_VARIABLE} at an "
            f"existing file, or unset it to use ~/{ENV_FILE_NAME} and ./{ENV_FILE_NAME}."
        )
    return found


def _same_file(first: Path, second: Path) -> bool:
    try:
        return first.samefile(second)
    except OSError:
        return False


def _read_env_file(path: Path) -> str:
    try:
        # Only regular files get here (env_file_paths), so their size is known before reading them whole.
        if path.stat().st_size > MAX_ENV_FILE_BYTES:
            raise EnvFileError(
                f"env file {path} is larger than {MAX_ENV_FILE_BYTES // 2**20} MiB, more than any environment "
                f"holds; it should hold KEY=VALUE lines: move it away, or set {ENV_FILE_VARIABLE} to the right file."
            )
        # surrogateescape: one stray non-UTF-8 byte then skips its line instead of the whole file.
        return path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as err:
        raise EnvFileError(
            f"cannot read env file {path}: {err.strerror or err}; make it readable, or move it away "
            f"(or set {ENV_FILE_VARIABLE} to another file)."
        ) from None


# --------------------------------------------------------------------------- --env flags and the whole job


def parse_env_flags(flags: Sequence[str]) -> dict[str, str]:
    """Variables from ``--env KEY=VALUE`` flags (each item of `flags` is one KEY=VALUE); later ones win."""
    values: dict[str, str] = {}
    for flag in flags:
        key, equals, value = flag.partition("=")
        if not equals:
            raise EnvFileError(
                f"--env {flag}: expected KEY=VALUE, e.g. --env NCCL_DEBUG=INFO (write --env {flag}= for an "
                f"empty value)."
            )
        if not _NAME.fullmatch(key):
            raise EnvFileError(
                f"--env {flag}: `{key}` is not a variable name; names are letters, digits and _, not starting "
                f"with a digit, with nothing around the '=' (e.g. --env NCCL_DEBUG=INFO)."
            )
        if is_process_specific(key):
            hint = _DENIED_FLAG_HINTS.get(key, "leave it out")
            raise EnvFileError(
                f"--env {flag}: {key} is set separately for each process or machine, so one value cannot be "
                f"given to the whole job; {hint}."
            )
        values[key] = value
    return values


def job_environment(
    environ: Mapping[str, str], *, cwd: str, home: str, env_flags: Sequence[str] = ()
) -> tuple[dict[str, str], list[str]]:
    """The variables every node of the job gets, and warnings to show the user.

    `environ` is the launching shell's environment, `cwd` and `home` the folders
    the env files are looked up in, `env_flags` the ``--env`` flag values. See
    the module docstring for the order; process-specific variables from env
    files are dropped with one warning that lists them.
    """
    flag_values = parse_env_flags(env_flags)  # first: a bad flag is reported before any file is read
    env = {name: value for name, value in environ.items() if is_exported(name)}
    warnings: list[str] = []
    dropped: set[str] = set()
    dropped_from: list[str] = []  # files that had some, in reading order
    for path in env_file_paths(environ, cwd, home):
        values, file_warnings = parse_env_file_text(_read_env_file(path), str(path))
        warnings.extend(file_warnings)
        for name, value in values.items():
            if is_process_specific(name):
                dropped.add(name)
                if str(path) not in dropped_from:
                    dropped_from.append(str(path))
            else:
                env[name] = value
    if dropped:
        plural = len(dropped) > 1
        warnings.append(
            f"ignored {len(dropped)} variable{'s' if plural else ''} from {', '.join(dropped_from)} that "
            f"{'are' if plural else 'is'} set "
            f"separately for each process or machine, so one value would be wrong on the others: "
            f"{', '.join(sorted(dropped))}."
        )
    env.update(flag_values)
    return env, warnings
