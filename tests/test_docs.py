"""The commands and configs in README.md and docs/*.md run: each is checked by zerotrain's own parsers.

What is collected, and how each kind is checked (one test case per command or block, named
``FILE:LINE``, ``FILE:LINE#2`` for a second command on one line, so a failure says which doc line
broke; ``python`` blocks are examples of the API and are not run):

- **Commands**: every line of a fenced shell block (``bash``, ``sh``, ``shell``, ``console``,
  ``text`` or no language) and every inline code span in prose that starts with ``zerotrain ``
  (after an optional ``$ `` prompt; ``\\`` continuations joined, ``# comments`` dropped by shlex).
  In a ``console`` block only ``$ `` lines are commands (the rest is output).  ``python -m zerotrain
  ...``, ``torchrun ... -m zerotrain ...`` and ``zerotrain launch --module zerotrain ...`` are checked
  as the zerotrain command they run.  ``train`` goes through ``split_train_argv`` and then
  ``load_train_config`` with its ``--section.key VALUE`` overrides (over the doc's own block of that
  file name when the doc has one, else over the built-in default config), so a misspelt key or a bad
  value fails; every other subcommand goes through ``build_parser().parse_args``.
- **Usage synopses**: a command with an optional part (``[--flag N]``, ``[CONFIG.yaml]``) or ``...`` is
  a synopsis, not something to run: each flag in it must be a flag the subcommand accepts.
  ``--section.key`` is the placeholder for ``train`` overrides.
- **Command names** in prose (``zerotrain consolidate`` in backquotes): the subcommand must exist.
- **JSON blocks** (``json``, ``jsonc``, ``hjson``, or a plain block starting with ``{``) are DeepSpeed
  configs: loaded with ``load_config`` (comments allowed) and checked for features not built yet.
  One without ``"auto"`` values is also resolved for 2 ranks as ``zerotrain config check`` does; a
  fragment with none of the three batch-size keys gets ``train_micro_batch_size_per_gpu: 1`` first.
  A block with ``"auto"`` values is left to whoever fills them (a ``zerotrain train`` config naming it
  resolves it below).  Show JSON that is not a DeepSpeed config in a ``text`` block.
- **YAML blocks** with a ``distributed_type`` key are ``accelerate config`` files, read by Accelerate's
  own ``ClusterConfig.from_yaml_file``.  Other **YAML blocks** are ``zerotrain train`` configs: loaded
  with ``load_train_config`` and their DeepSpeed
  section resolved as the trainer does (``build_engine_config``, 2 ranks, on a CPU).  A block without
  a ``model`` section is a fragment: it is checked as a layer over the built-in default config.
- **Named blocks**: a block whose first line is a comment naming a file (``# base.yaml``,
  ``// ds_config.json``) is written under that name, next to the doc's other named blocks, before
  any block of that doc is checked; so a YAML config may ``inherit:`` another block or point ``zero:``
  at a JSON block, and a ``zerotrain train base.yaml`` command loads that block.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn

from zerotrain.cli.main import build_parser
from zerotrain.config import check_supported, load_config, resolve_config
from zerotrain.config.loader import read_config_file
from zerotrain.train.command import split_train_argv
from zerotrain.train.config import DEFAULT_CONFIG_PATH
from zerotrain.train.config_files import load_train_config
from zerotrain.train.zero_fill import build_engine_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}
JSON_LANGS = {"json", "jsonc", "hjson"}
YAML_LANGS = {"yaml", "yml"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
FILE_NAME_COMMENT = re.compile(r"^\s*(?:#|//)\s*([\w.-]+\.(?:ya?ml|jsonc?|hjson))\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# `[--flag N]`, `[CONFIG.yaml]`, `...`: an optional part or a repetition marks a usage synopsis.
SYNOPSIS_TOKEN = re.compile(r"^\[(?:-|[A-Z])|\.\.\.\]?$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: where it starts (the line after the fence), its language and text."""

    doc: Path
    line: int
    lang: str
    text: str

    @property
    def file_name(self) -> str | None:
        """The file this block is, when its first line is a comment naming one."""
        first = self.text.split("\n", 1)[0]
        match = FILE_NAME_COMMENT.match(first)
        return match.group(1) if match else None


@dataclass(frozen=True)
class Command:
    """A `zerotrain ...` command shown in a doc."""

    doc: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {self.text}"


def fenced_blocks(doc: Path) -> list[Block]:
    """Every fenced code block of a Markdown file."""
    blocks: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.group(2), opening.group(3).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        blocks.append(Block(doc, i + 2, lang, textwrap.dedent("\n".join(lines[i + 1 : end]))))
        i = end + 1
    return blocks


def prose_lines(doc: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced blocks."""
    result, inside, fence = [], False, ""
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        opening = FENCE.match(line)
        if opening and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), opening.group(2)
            continue
        if not inside:
            result.append((number, line))
    return result


def zerotrain_tail(text: str) -> str | None:
    """The zerotrain command in a shell line (`zerotrain ...`, `python -m zerotrain ...`), else None."""
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:].strip()
    if text.startswith("zerotrain "):
        return text
    runner = re.match(r"^(?:python3?|torchrun)\b.*?\s-m\s+(zerotrain(?:\s.*)?)$", text)
    return runner.group(1) if runner else None


def shell_commands(block: Block) -> list[Command]:
    """The zerotrain commands of a shell block, `\\` continuations joined."""
    commands: list[Command] = []
    lines = block.text.split("\n")
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        if block.lang == "console" and not line.lstrip().startswith("$ "):
            continue
        tail = zerotrain_tail(line)
        if tail is not None:
            commands.append(Command(block.doc, block.line + start, tail))
    return commands


def collect() -> tuple[list[Command], list[Block], list[Block]]:
    """(commands, JSON blocks, YAML blocks) of every doc."""
    commands, json_blocks, yaml_blocks = [], [], []
    for doc in DOCS:
        for block in fenced_blocks(doc):
            if block.lang in JSON_LANGS or (block.lang == "" and block.text.lstrip().startswith("{")):
                json_blocks.append(block)
            elif block.lang in YAML_LANGS:
                yaml_blocks.append(block)
            elif block.lang in SHELL_LANGS:
                commands += shell_commands(block)
        for number, line in prose_lines(doc):
            for match in INLINE_CODE.finditer(line):
                tail = zerotrain_tail(match.group(2))
                if tail is not None:
                    commands.append(Command(doc, number, tail))
    return sorted(commands, key=lambda c: (str(c.doc), c.line)), json_blocks, yaml_blocks


def case_ids(items: list[Command] | list[Block]) -> list[str]:
    """`FILE:LINE` for each item, `FILE:LINE#2` for a second one on the same line."""
    ids: list[str] = []
    for item in items:
        base = f"{item.doc.relative_to(REPO)}:{item.line}"
        seen = sum(1 for i in ids if i == base or i.startswith(base + "#"))
        ids.append(f"{base}#{seen + 1}" if seen else base)
    return ids


COMMANDS, JSON_BLOCKS, YAML_BLOCKS = collect()


def write_named_blocks(doc: Path, folder: Path) -> dict[str, Path]:
    """Write the doc's named blocks into ``folder``; {file name: path}."""
    written = {}
    for block in fenced_blocks(doc):
        if block.file_name:
            written[block.file_name] = folder / block.file_name
            written[block.file_name].write_text(block.text + "\n", encoding="utf-8")
    return written


def block_path(block: Block, folder: Path, suffix: str) -> Path:
    """The block's file: its named file (written by write_named_blocks), else a new one."""
    named = write_named_blocks(block.doc, folder)
    if block.file_name:
        return named[block.file_name]
    path = folder / f"block_line{block.line}{suffix}"
    path.write_text(block.text + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- #
# commands


def subcommand_parsers() -> dict[tuple[str, ...], object]:
    """{("config", "check"): its argparse parser, ...} for every subcommand of `zerotrain`."""
    found: dict[tuple[str, ...], object] = {}

    def walk(parser, prefix: tuple[str, ...]) -> None:
        for action in parser._actions:  # argparse keeps its subparsers here; there is no public accessor
            if getattr(action, "choices", None) and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    found[(*prefix, name)] = sub
                    walk(sub, (*prefix, name))

    walk(build_parser(), ())
    return found


SUBCOMMANDS = subcommand_parsers()


def split_subcommand(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the longest subcommand path the words start with, the rest)."""
    path: tuple[str, ...] = ()
    while len(path) < len(words) and (*path, words[len(path)]) in SUBCOMMANDS:
        path = (*path, words[len(path)])
    return path, words[len(path) :]


def is_synopsis(words: list[str]) -> bool:
    return any(SYNOPSIS_TOKEN.search(word) for word in words)


def check_synopsis(command: Command, words: list[str]) -> None:
    path, rest = split_subcommand(words)
    if not path:
        pytest.fail(f"{command}\n  no such zerotrain subcommand: {words[:1]}", pytrace=False)
    if path == ("run",):
        rest = []  # `zerotrain run COMMAND ...`: every flag after it is COMMAND's
    flags = [name.split("=", 1)[0] for word in rest for name in word.strip("[]").split("|") if name.startswith("-")]
    for flag in flags:
        if path == ("train",):
            if flag == "--section.key":
                continue  # the placeholder for overrides
            try:
                split_train_argv([flag, "1"])
            except ValueError as error:
                pytest.fail(f"{command}\n  zerotrain train has no flag {flag}: {error}", pytrace=False)
        else:
            known = SUBCOMMANDS[path]._option_string_actions
            if flag not in known:
                pytest.fail(f"{command}\n  zerotrain {' '.join(path)} has no flag {flag} (see its --help)", pytrace=False)


def check_train(command: Command, args: list[str], named: dict[str, Path]) -> None:
    try:
        config, flags, overrides = split_train_argv(args)
    except ValueError as error:
        pytest.fail(f"{command}\n  zerotrain train refuses it: {error}", pytrace=False)
    if flags["help"]:
        return
    # The doc's own block when it shows the file; else the overrides are checked on the default config.
    base = named.get(Path(config).name) if config else None
    try:
        load_train_config(base, overrides)
    except Exception as error:  # noqa: BLE001 - any failure is the doc's fault, reported with its line
        pytest.fail(f"{command}\n  its config/overrides do not load: {error}", pytrace=False)


def check_argparse(command: Command, words: list[str]) -> None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(words)
    except SystemExit as exit_:
        if exit_.code != 0:
            pytest.fail(f"{command}\n  {stderr.getvalue().strip()}", pytrace=False)
        return  # --help / --version
    if getattr(args, "command", None) == "launch" and args.module and args.script == "zerotrain":
        check_command(Command(command.doc, command.line, shlex.join(["zerotrain", *args.script_args])), {})


def check_command(command: Command, named: dict[str, Path]) -> None:
    words = shlex.split(command.text, comments=True)[1:]
    path, rest = split_subcommand(words)
    if path and not rest and path != ("train",):
        return  # a command's name in prose, e.g. `zerotrain consolidate`: it exists
    if is_synopsis(words):
        check_synopsis(command, words)
    elif words[:1] == ["train"]:
        check_train(command, words[1:], named)
    else:
        check_argparse(command, words)


@pytest.mark.parametrize("command", COMMANDS, ids=case_ids(COMMANDS))
def test_documented_command_parses(command: Command, tmp_path: Path):
    check_command(command, write_named_blocks(command.doc, tmp_path))


def test_docs_show_commands_of_every_subcommand():
    # Guards the collector: if it stopped finding commands, every test above would pass vacuously.
    shown = {split_subcommand(shlex.split(c.text, comments=True)[1:])[0] for c in COMMANDS}
    missing = [" ".join(path) for path in SUBCOMMANDS if path != ("config",) and path not in shown]
    assert not missing, f"no doc shows a `zerotrain {missing[0]}` command"


# --------------------------------------------------------------------------- #
# configs


def contains_auto(data: object) -> bool:
    if isinstance(data, dict):
        return any(contains_auto(v) for v in data.values())
    if isinstance(data, list):
        return any(contains_auto(v) for v in data)
    return data == "auto"


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=case_ids(JSON_BLOCKS))
def test_documented_deepspeed_config_is_valid(block: Block, tmp_path: Path):
    path = block_path(block, tmp_path, ".jsonc")
    where = f"{block.doc.relative_to(REPO)}:{block.line}"
    try:
        cfg = load_config(path)
        check_supported(cfg)
        data = read_config_file(path)
        if not contains_auto(data):
            if not any(key in data for key in BATCH_KEYS):
                data = {**data, "train_micro_batch_size_per_gpu": 1}  # a fragment: the smallest whole config
            resolve_config(load_config(data), world_size=2, model=None)
    except Exception as error:  # noqa: BLE001 - any failure is the doc's fault, reported with its line
        pytest.fail(f"{where}: the DeepSpeed config block is invalid:\n{error}", pytrace=False)


class StandInModel(nn.Module):
    """Enough of a Hugging Face model for "auto" bucket sizes: a parameter and config.hidden_size."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        self.config = SimpleNamespace(hidden_size=hidden_size)


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=case_ids(YAML_BLOCKS))
def test_documented_train_config_is_valid(block: Block, tmp_path: Path):
    where = f"{block.doc.relative_to(REPO)}:{block.line}"
    data = yaml.safe_load(block.text) or {}
    if not isinstance(data, dict):
        pytest.fail(f"{where}: a ```yaml block must be a zerotrain train config (a mapping)", pytrace=False)
    path = block_path(block, tmp_path, ".yaml")
    if "distributed_type" in data:  # an `accelerate config` file (docs/huggingface.md): Accelerate reads it
        from accelerate.commands.config.config_args import ClusterConfig

        path.write_text(block.text, encoding="utf-8")
        try:
            ClusterConfig.from_yaml_file(str(path))
        except Exception as error:  # noqa: BLE001
            pytest.fail(f"{where}: Accelerate cannot read this config:\n{error}", pytrace=False)
        return
    if "model" not in data and "inherit" not in data:
        # A fragment: the same keys as a layer over the built-in default.
        path.write_text(yaml.safe_dump({"inherit": [str(DEFAULT_CONFIG_PATH)], **data}), encoding="utf-8")
    try:
        cfg = load_train_config(path)
        hidden = cfg.model.config_overrides.get("hidden_size", 64)
        build_engine_config(cfg, model=StandInModel(hidden), world_size=2, device_type="cpu",
                            total_steps=cfg.training.max_steps or 100)
    except Exception as error:  # noqa: BLE001 - any failure is the doc's fault, reported with its line
        pytest.fail(f"{where}: the zerotrain train config block is invalid:\n{error}", pytrace=False)


def test_every_fenced_block_is_classified():
    # A block in a language this test does not read (say ```toml) would go unchecked: make that visible.
    # ```output: what a command prints, shown as it appears (not commands to run).
    known = SHELL_LANGS | JSON_LANGS | YAML_LANGS | {"python", "output"}
    unread = [f"{b.doc.relative_to(REPO)}:{b.line} ```{b.lang}" for doc in DOCS for b in fenced_blocks(doc)
              if b.lang not in known]
    assert not unread, f"blocks in a language tests/test_docs.py does not check: {unread}"
