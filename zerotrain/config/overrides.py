"""Values given on the command line, read the one way every command reads them.

`zerotrain train --section.key VALUE`, `zerotrain config check --set KEY=VALUE` and the planning
commands' `--config-override KEY=VALUE` all read VALUE as YAML reads it in a config file
(``4`` an int, ``1e-4`` a float, ``true`` a bool, ``[0.9, 0.95]`` a list, ``null`` None); text
that is not valid YAML stays a string, so ``adam`` or ``x=y`` need no quotes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerotrain.config.errors import ConfigError


def override_value(text: str, origin: str) -> Any:
    """`text` as a config file's YAML would read it; the text itself when it is not valid YAML."""
    from zerotrain.config.loader import _parse_yaml  # here: loader builds the schema, which --help does not need

    try:
        return _parse_yaml(text, origin)
    except ConfigError:
        return text


def parse_key_values(items: Sequence[str], flag: str, example: str) -> dict[str, Any]:
    """``["a.b=1e-3", "c=x"]`` -> ``{"a.b": 0.001, "c": "x"}``; ValueError naming `flag` and an
    `example` for an item without ``=`` or without a key."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
        values[key.strip()] = override_value(text, f"{flag} {key.strip()}")
    return values
