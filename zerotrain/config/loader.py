"""Reading a config from wherever users keep it: a dict, a JSON/hjson/YAML file,
or a base64-encoded JSON string (as DeepSpeed's launcher passes it around).

JSON files are read with hjson, as DeepSpeed does, so ``#`` and ``//`` comments
and trailing commas in copied guide configs are accepted.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

import hjson
import yaml
from pydantic import ValidationError

from zerotrain.config.errors import ConfigError, describe_validation_error
from zerotrain.config.schema import ZeroTrainConfig

ConfigSource = ZeroTrainConfig | Mapping[str, Any] | str | os.PathLike

_JSON_SUFFIXES = {".json", ".jsonc", ".hjson"}
_YAML_SUFFIXES = {".yaml", ".yml"}
_BASE64_ALPHABET = re.compile(r"^[A-Za-z0-9+/=_\-\s]+$")
log = logging.getLogger("zerotrain")


def load_config(source: ConfigSource) -> ZeroTrainConfig:
    """Read and validate a config.

    ``source`` is a dict, a path to a ``.json``/``.jsonc``/``.hjson`` or
    ``.yaml``/``.yml`` file, a base64-encoded JSON string, or an already built
    ``ZeroTrainConfig`` (returned as is).  "auto" values are kept as the string
    "auto"; ``resolve_config`` fills them.  Raises ConfigError with a message
    naming the file, key and value at fault.
    """
    if isinstance(source, ZeroTrainConfig):
        return source
    if isinstance(source, Mapping):
        return validate_config_dict(source)
    if isinstance(source, os.PathLike):
        return validate_config_dict(read_config_file(Path(source)), origin=str(source))
    if isinstance(source, str):
        if os.path.exists(source) or not _could_be_base64(source):
            return validate_config_dict(read_config_file(Path(source)), origin=source)
        decoded = _decode_base64(source)
        if decoded is None:
            raise ConfigError(f"config file not found: {source} (and it is not base64-encoded JSON either)")
        return validate_config_dict(decoded, origin="the base64-encoded config")
    raise ConfigError(
        f"cannot read a config from a {type(source).__name__}: pass a dict, a file path or base64-encoded JSON"
    )


def validate_config_dict(data: Mapping[str, Any], origin: str | None = None) -> ZeroTrainConfig:
    """Validate a plain dict against the schema, turning pydantic errors into ConfigError."""
    try:
        return ZeroTrainConfig.model_validate(_without_dotted_section_keys(dict(data), origin))
    except ValidationError as error:
        where = f" in {origin}" if origin else ""
        details = _indent(describe_validation_error(error, ZeroTrainConfig))
        raise ConfigError(f"invalid zerotrain config{where}:\n{details}") from None


def _without_dotted_section_keys(data: dict[str, Any], origin: str | None) -> dict[str, Any]:
    """Drops top-level keys such as "zero_optimization.reduce_bucket_size", saying so.

    DeepSpeed reads only the keys it knows, so such a key changes nothing there; TRL writes three
    of them for its ZeRO-3 reference model. They are dropped here too, where they would otherwise be
    unknown keys. A dotted key whose first part is not a section stays an error (a typo).
    """
    sections = {field.alias or name for name, field in ZeroTrainConfig.model_fields.items()}
    dotted = [k for k in data if isinstance(k, str) and "." in k and k.split(".", 1)[0] in sections]
    if dotted:
        where = f" in {origin}" if origin else ""
        log.warning(
            "config%s: top-level keys %s have no effect, as in DeepSpeed (which reads only the keys "
            "it knows); to change a setting, put it inside its section", where, ", ".join(map(repr, dotted)))
    return {k: v for k, v in data.items() if k not in dotted}


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a config file into a dict; the suffix picks YAML, anything else is read as hjson."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a directory, not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    if path.suffix.lower() in _YAML_SUFFIXES:
        data = _parse_yaml(text, str(path))
    else:
        data = _parse_hjson(text, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys to values, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- #
# parsers


def _parse_hjson(text: str, origin: str) -> Any:
    try:
        return hjson.loads(text, object_pairs_hook=_pairs_without_duplicates(origin))
    except hjson.HjsonDecodeError as error:
        raise ConfigError(f"{origin}, line {error.lineno} column {error.colno}: cannot parse: {error.msg}") from None


def _parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_ConfigYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{origin}{where}: cannot parse: {error.problem or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: cannot parse: {error}") from None


def _pairs_without_duplicates(origin: str):
    # DeepSpeed refuses duplicate keys; silently keeping the last one hides typos.
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ConfigError(f"{origin}: key '{key}' appears twice in the same section")
            result[key] = value
        return result

    return build


class _ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``5e8`` as a number.

    YAML 1.1 wants a dot in a float (``5.0e+8``), so PyYAML reads ``5e8`` as a
    string; DeepSpeed users write bucket sizes that way.
    """


_ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _could_be_base64(text: str) -> bool:
    # base64 has no '.', so a dotted name such as "ds_config.json" is a file path.
    return "." not in text and bool(_BASE64_ALPHABET.match(text))


def _decode_base64(text: str) -> dict[str, Any] | None:
    """The dict a base64-encoded JSON string holds, or None if it holds none."""
    compact = "".join(text.split())
    try:
        decoded = base64.urlsafe_b64decode(compact + "=" * (-len(compact) % 4)).decode("utf-8")
        data = hjson.loads(decoded)
    except (binascii.Error, ValueError, hjson.HjsonDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())
