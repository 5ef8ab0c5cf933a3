"""How configuration problems are reported: one exception type, human messages.

pydantic's own error dump names union members and internal types; users of a
DeepSpeed-style JSON file need the dotted key they wrote, the value they gave and
what would have been accepted.  ``describe_validation_error`` turns a pydantic
``ValidationError`` into exactly that, one line per problem.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

if TYPE_CHECKING:  # pydantic is imported where a model is inspected: every command imports this module
    from pydantic import BaseModel, ValidationError
    from pydantic.fields import FieldInfo

# Error type of the messages our own validators raise (PydanticCustomError):
# their text is already meant for a human and is passed through unchanged.
CUSTOM_ERROR_TYPE = "zerotrain_config"

AUTO = "auto"


class UserInputError(Exception):
    """An error in what the user gave (a config, a file, a command line, a checkpoint, a run folder):
    its message says what is wrong and how to fix it, so it is shown without a traceback. Each
    layer's own error classes derive from it; `config/error_report.py` relies on that alone."""


class ConfigError(ValueError, UserInputError):
    """A configuration that zerotrain cannot use, with a message saying what to change."""


def describe_validation_error(error: ValidationError, model: type[BaseModel]) -> str:
    """Turn a pydantic ``ValidationError`` raised while validating ``model`` into one
    human-readable line per problem (deduplicated, in input order)."""
    lines: list[str] = []
    seen_paths: set[tuple[str, ...]] = set()
    for item in error.errors(include_url=False):
        path, field, parent = _walk_location(model, item["loc"])
        # A value that fails a union (int | "auto") yields one error per member:
        # report the key once.
        if item["type"] != "extra_forbidden" and path in seen_paths:
            continue
        seen_paths.add(path)
        lines.append(_describe_one(item, path, field, parent))
    return "\n".join(lines)


def format_problems(header: str, problems: list[str]) -> str:
    """Join several problems under one header, or return the only one alone."""
    if len(problems) == 1:
        return problems[0]
    return header + "\n" + "\n".join(f"  - {p}" for p in problems)


def render_value(value: Any) -> str:
    """Show a value as it would appear in a JSON config file."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


# --------------------------------------------------------------------------- #
# internals


def _describe_one(
    item: dict[str, Any],
    path: tuple[str, ...],
    field: FieldInfo | None,
    parent: type[BaseModel] | None,
) -> str:
    dotted = ".".join(path) if path else "config"
    kind = item["type"]
    if kind == CUSTOM_ERROR_TYPE:
        return item["msg"] if not path else f"{dotted}: {item['msg']}"
    if kind == "extra_forbidden":
        key = path[-1]
        message = f"{dotted}: unknown key '{key}'"
        if parent is not None:
            match = difflib.get_close_matches(key, _accepted_keys(parent), n=1, cutoff=0.6)
            if match:
                message += f"; did you mean '{match[0]}'?"
        return message
    if kind == "missing":
        return f"{dotted}: required key is missing"
    given = item.get("input")
    expected = describe_type(field.annotation, field.metadata) if field is not None else None
    if expected is None:
        return f"{dotted}: got {render_value(given)}: {item['msg']}"
    if given == AUTO:
        return (
            f'{dotted}: got "auto", but zerotrain has no rule to fill this key; '
            f"expected {expected}"
        )
    return f"{dotted}: got {render_value(given)}, expected {expected}"


def _walk_location(
    model: type[BaseModel], loc: tuple[Any, ...]
) -> tuple[tuple[str, ...], FieldInfo | None, type[BaseModel] | None]:
    """Map a pydantic error location to the keys the user wrote.

    Returns the cleaned path, the FieldInfo of the last key (None when the key is
    not a field, e.g. an unknown key) and the model that holds the last key.
    """
    path: list[str] = []
    current: type[BaseModel] | None = model
    field: FieldInfo | None = None
    holder: type[BaseModel] | None = None
    skip_union_tag = False
    for part in loc:
        if skip_union_tag:
            # pydantic names the union member that failed; users never wrote it.
            skip_union_tag = False
            continue
        path.append(str(part))
        if current is None:
            field, holder = None, None
            continue
        holder = current
        field = _field_by_key(current, str(part))
        if field is None:
            current = None
            continue
        current = _model_inside(field.annotation)
        skip_union_tag = current is None and _is_union(field.annotation)
    return tuple(path), field, holder


def _field_by_key(model: type[BaseModel], key: str) -> FieldInfo | None:
    for name, info in model.model_fields.items():
        if key == name or key == info.alias:
            return info
    return None


def _accepted_keys(model: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        keys.append(info.alias or name)
        if info.alias:
            keys.append(name)
    keys.extend(getattr(model, "extra_accepted_keys", ()))
    return keys


def _is_union(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin not in (Union, types.UnionType):
        return False
    return len([a for a in typing.get_args(annotation) if a is not type(None)]) > 1


def _model_inside(annotation: Any) -> type[BaseModel] | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if _model_inside(a)]
        if len(models) == 1 and not _is_union(annotation):
            return _model_inside(models[0])
    return None


def describe_type(annotation: Any, metadata: list[Any] | None = None) -> str | None:
    """Say in words which values a field accepts ("a positive integer or \"auto\"")."""
    from pydantic import BaseModel

    metadata = list(metadata or [])
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        flat: list[Any] = []
        for item in extra:
            flat.extend(getattr(item, "metadata", [item]))
        return describe_type(inner, metadata + flat)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [describe_type(a, metadata) or "?" for a in members]
        if type(None) in typing.get_args(annotation):
            words.append("null")
        return " or ".join(words)
    if origin is Literal:
        options = [render_value(v) for v in typing.get_args(annotation)]
        return options[0] if len(options) == 1 else "one of " + ", ".join(options)
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return _with_bounds("an integer", metadata)
    if annotation is float:
        return _with_bounds("a number", metadata)
    if annotation is str:
        return "a string"
    if annotation is Path:
        return "a filesystem path"
    if origin is dict or annotation is dict:
        return "a mapping of keys to values"
    if origin is list or annotation is list:
        return "a list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a section (a mapping of keys to values)"
    if annotation is Any:
        return None
    return None


def _with_bounds(noun: str, metadata: list[Any]) -> str:
    bounds: dict[str, Any] = {}
    for item in metadata:
        for attr in ("ge", "gt", "le", "lt"):
            value = getattr(item, attr, None)
            if value is not None:
                bounds[attr] = value
    kind = noun.split(" ", 1)[1]
    if bounds == {"gt": 0}:
        return f"a positive {kind}"
    if bounds == {"ge": 0}:
        return f"a non-negative {kind}"
    if set(bounds) == {"ge", "le"}:
        return f"{noun} from {bounds['ge']} to {bounds['le']}"
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{words[k]} {v}" for k, v in bounds.items()]
    return f"{noun} {' and '.join(parts)}" if parts else noun
