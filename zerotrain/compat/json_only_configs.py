"""DeepSpeed config files that transformers and Accelerate open with `json.load`, checked before launch.

zerotrain reads a DeepSpeed JSON with hjson (`#`/`//` comments and trailing commas are fine), but
a file given to the Trainer (`--deepspeed ds.json`, TRL and LLaMA-Factory alike) or to Accelerate
(`deepspeed_config_file`) is opened by the library with plain `json.load` in every rank, before
zerotrain sees it: one comment and every rank dies with JSONDecodeError. `zerotrain launch` and
`zerotrain run` find those arguments and stop first, naming the file, the line, and a command that
writes a plain-JSON copy. A DeepSpeed script's own `--deepspeed_config ds.json` is read by zerotrain
(`initialize`), so it is not checked: comments keep working there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from zerotrain.compat.accelerate_launch_args import AccelerateLaunch, Setting
from zerotrain.config.errors import ConfigError

TRAINER_FLAG = "--deepspeed"
"""TrainingArguments' field (HfArgumentParser): a DeepSpeed JSON path, or a dict in code."""
JSON_SUFFIXES = (".json", ".jsonc", ".hjson")
"""What a `--deepspeed` value must end with to be checked: a DeepSpeed script's own `--deepspeed`
is a flag, and the word after it may be any file of its own."""
ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
"""Where Accelerate's ranks look for the DeepSpeed config file (launch sets it from its settings)."""


def trainer_config_arguments(words: Sequence[str]) -> list[Setting]:
    """The existing JSON files given as `--deepspeed FILE` or `--deepspeed=FILE` anywhere in `words`."""
    found = []
    for index, word in enumerate(words):
        if word == TRAINER_FLAG and index + 1 < len(words):
            value = words[index + 1]
        elif word.startswith(TRAINER_FLAG + "="):
            value = word.split("=", 1)[1]
        else:
            continue
        if value.lower().endswith(JSON_SUFFIXES) and Path(value).is_file():
            found.append(Setting(value, f"{TRAINER_FLAG} on the command line", TRAINER_FLAG + " {}"))
    return found


def accelerate_config_arguments(launch: AccelerateLaunch, env: Mapping[str, str]) -> list[Setting]:
    """The DeepSpeed config file an `accelerate launch` with DeepSpeed hands its ranks (any name:
    Accelerate opens it with json.load whatever its suffix), and the script's own `--deepspeed`."""
    found = trainer_config_arguments(launch.script_words)
    if not launch.uses_deepspeed:
        return found
    chosen = launch.setting("deepspeed_config_file", "deepspeed_config_file", "deepspeed_config")
    if chosen is None and env.get(ACCELERATE_CONFIG_ENV):  # launch passes the user's own on unchanged
        chosen = Setting(env[ACCELERATE_CONFIG_ENV], "the environment", ACCELERATE_CONFIG_ENV + "={}")
    if chosen is not None and Path(chosen.value).is_file():
        found.append(chosen)
    return found


def check_json_loadable(arguments: Iterable[Setting]) -> None:
    """Raises ConfigError for the first file that `json.load` rejects, with the line and the fix."""
    for argument in arguments:
        problem = _json_load_problem(argument)
        if problem:
            raise ConfigError(problem)


def plain_json_copy_name(path: Path) -> Path:
    """Where the fix writes the comment-free copy: ds.json -> ds.plain.json, beside it."""
    return path.with_name(f"{path.stem}.plain.json")


def _json_load_problem(argument: Setting) -> str | None:
    path = Path(argument.value)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # the library says what is wrong with a file it cannot read
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as error:
        stop = error
    given = argument.given_as()
    why = ("transformers and Accelerate read a DeepSpeed config file with json.load, which takes plain JSON "
           "only, so every rank would stop with JSONDecodeError")
    if not _zerotrain_reads(path):
        return (f"{given}: {path} is not valid JSON at line {stop.lineno} column {stop.colno} "
                f"({stop.msg}); {why}. Fix the file (`zerotrain config check {path}` shows what is wrong).")
    copy = plain_json_copy_name(path)
    return (f"{given}: {path} has {_what_stops(text, stop)}; {why}. Write a plain JSON copy and give "
            f"that instead: `zerotrain config check {path} --write-json {copy}`, then "
            f"{argument.given_as(copy)} (or edit {path} into plain JSON: no comments, no trailing commas).")


def _what_stops(text: str, error: json.JSONDecodeError) -> str:
    """The JSON extension json.load stops at, and its line, as a reader would name it."""
    rest = text[error.pos:]
    if rest.startswith(("#", "//", "/*")):
        return f"a comment on line {error.lineno} ({rest.splitlines()[0].strip()[:60]})"
    before = text[:error.pos].rstrip()
    if rest[:1] in ("}", "]") and before.endswith(","):
        comma_line = before.count("\n") + 1
        return f"a trailing comma on line {comma_line}"
    return f"what json.load cannot read at line {error.lineno} column {error.colno} ({error.msg})"


def _zerotrain_reads(path: Path) -> bool:
    """Whether zerotrain's config loader (hjson) reads the file as a config."""
    from zerotrain.config.loader import read_config_file

    try:
        read_config_file(path)
    except ConfigError:
        return False
    return True
