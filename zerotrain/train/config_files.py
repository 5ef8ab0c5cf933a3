"""Reading `zerotrain train` config files: `inherit` chains, deep merges and `--section.key VALUE` overrides.

The result is handed to `validate_train_config` (zerotrain/train/config.py), which owns the schema.
"""

from __future__ import annotations

import copy
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import BaseModel

from zerotrain.config.errors import ConfigError, render_value
from zerotrain.config.loader import read_config_file
from zerotrain.config.overrides import override_value
from zerotrain.train.config import (
    DEFAULT_CONFIG_PATH,
    MODEL_SOURCES,
    TrainConfig,
    mark_user_set,
    validate_train_config,
)
from zerotrain.train.zero_links import adopt_deepspeed_values


def load_train_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read, merge, override and validate a config; ``path`` None reads the built-in default.

    ``overrides`` are command-line tokens: ``--section.key VALUE`` or ``--section.key=VALUE``.
    Raises ConfigError naming the file and the dotted key, for every problem at once.
    """
    file = Path(path).expanduser() if path is not None else DEFAULT_CONFIG_PATH
    data, inherited = _read_with_inherit(file)
    pairs = parse_overrides(overrides)
    for dotted, value in pairs:
        _apply_override(data, dotted, value)
    origin = str(path) if path is not None else f"the built-in default config ({DEFAULT_CONFIG_PATH})"
    if inherited:
        origin += f" (inheriting {', '.join(str(p) for p in inherited)})"
    if pairs:
        origin += " with the command-line overrides"
    cfg = validate_train_config(data, origin)
    if path is None:
        # The built-in default's training values are defaults, not the user's choices: a DeepSpeed
        # value given with a --zero.* flag wins over them silently, as over any default.
        mark_user_set(cfg.training, {dotted.split(".")[1] for dotted, _ in pairs if dotted.startswith("training.")})
    return adopt_deepspeed_values(cfg)


class _WholeSection(dict):
    """A ``zero`` read from a file: it replaces an inherited ``zero`` instead of merging into it,
    because a DeepSpeed file is a complete config."""


def _read_with_inherit(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[Path]]:
    """The file's data merged over the files it inherits (recursively), and those files."""
    identity = path.resolve()
    if identity in chain:
        cycle = " -> ".join(str(p) for p in (*chain, identity))
        raise ConfigError(f"inherit cycle: {cycle}: remove one of these inherit entries")
    data = read_config_file(path)
    if isinstance(data.get("zero"), (str, os.PathLike)):
        zero_path = path.parent / Path(data["zero"]).expanduser()
        try:
            data["zero"] = _WholeSection(read_config_file(zero_path))
        except ConfigError as error:
            raise ConfigError(f"{path}: zero: {error}") from None
    bases = data.pop("inherit", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: inherit: got {render_value(bases)}, expected a list of file paths")
    merged: dict[str, Any] = {}
    inherited: list[Path] = []
    for base in bases:
        base_path = path.parent / Path(base).expanduser()
        if not base_path.is_file():
            raise ConfigError(f"{path}: inherit: {base} not found (looked for {base_path}); fix the path")
        base_data, base_inherited = _read_with_inherit(base_path, (*chain, identity))
        merged = _merge(merged, base_data)
        inherited += [*base_inherited, base_path]
    return _merge(merged, data), inherited


def _merge(base: Mapping[str, Any], layer: Mapping[str, Any], top: bool = True) -> dict[str, Any]:
    """Deep merge: mappings merge key by key; lists and scalars in ``layer`` replace those in ``base``."""
    result = dict(base)
    if top and isinstance(layer.get("model"), Mapping) and isinstance(result.get("model"), Mapping):
        result["model"] = _without_other_sources(result["model"], layer["model"])
    for key, value in layer.items():
        if isinstance(value, _WholeSection):
            result[key] = dict(value)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _merge(result[key], value, top=False)
        else:
            result[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)
    return result


def _without_other_sources(model: Mapping[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
    # path/config/architecture are one choice: choosing one later drops an inherited other.
    picked = {key for key in MODEL_SOURCES if chosen.get(key) is not None}
    return {k: v for k, v in model.items() if not picked or k not in MODEL_SOURCES or k in picked}


# --------------------------------------------------------------------------- #
# command-line overrides


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--training.lr", "1e-4", "--zero.zero_optimization.stage=3"]`` -> ``[("training.lr", 0.0001), ...]``.

    Values are read as YAML scalars/flow collections: ``4`` an int, ``1e-4`` a float, ``true`` a
    bool, ``[0.9,0.95]`` a list, ``null`` None; text that is not valid YAML stays a string.
    ``--zero PATH`` replaces the whole DeepSpeed section with a file.
    """
    pairs: list[tuple[str, Any]] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = str(tokens[i])
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: overrides are written --section.key VALUE")
        dotted, has_value, text = token[2:].partition("=")
        if not has_value:
            if i + 1 >= len(tokens) or str(tokens[i + 1]).startswith("--"):
                raise ConfigError(f"--{dotted} is missing its value: write --{dotted} VALUE")
            text = str(tokens[i + 1])
            i += 1
        i += 1
        parts = dotted.split(".")
        if (len(parts) < 2 and dotted != "zero") or not all(parts):
            raise ConfigError(
                f"{token!r} is not an override: write --section.key VALUE, e.g. --training.micro_batch_size 4 "
                f"(sections: {', '.join(_section_names())})"
            )
        pairs.append((dotted, override_value(text, f"--{dotted}")))
    return pairs


def _apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    _check_override_key(parts)
    if parts == ["zero"] and isinstance(value, str):
        try:
            value = read_config_file(Path(value).expanduser())
        except ConfigError as error:
            raise ConfigError(f"--zero: {error}") from None
    node = data
    for depth, key in enumerate(parts[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"--{dotted}: {where} is {render_value(child)}, not a section, so it has no keys")
        node = child
    if parts[0] == "model" and len(parts) == 2 and parts[1] in MODEL_SOURCES and value is not None:
        for other in MODEL_SOURCES:
            node.pop(other, None)
    node[parts[-1]] = value


def _check_override_key(parts: list[str]) -> None:
    """Refuse an override naming a key no section has, suggesting the nearest one."""
    section: type[BaseModel] | None = TrainConfig
    for depth, key in enumerate(parts):
        if section is None:
            return  # inside a free-form mapping (zero, model.config_overrides), validated later
        fields = [name for name in section.model_fields if name != "inherit"]
        if key not in fields:
            message = f"--{'.'.join(parts)}: " + (
                f"unknown key '{key}' in {'.'.join(parts[:depth])}" if depth else f"unknown section '{key}'"
            )
            match = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{match[0]}'?" if match else f" (known: {', '.join(fields)})"
            raise ConfigError(message + hint)
        annotation = section.model_fields[key].annotation
        section = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        is_mapping = annotation is dict or typing.get_origin(annotation) is dict
        if section is None and not is_mapping and depth < len(parts) - 1:
            raise ConfigError(f"--{'.'.join(parts)}: {'.'.join(parts[: depth + 1])} is a value, not a section")


def _section_names() -> list[str]:
    return [name for name in TrainConfig.model_fields if name != "inherit"]
