"""How data problems are reported: one exception type whose message says where and what to do.

A training run that dies on line 48 213 of a 2 GB JSONL file must say so, show
the offending text and name the config key or edit that fixes it; a bare
``JSONDecodeError`` or ``KeyError`` from deep inside a reader does neither.
"""

from __future__ import annotations

from pathlib import Path

# Longest excerpt of a bad line quoted in a message: enough to recognise it,
# short enough that a minified megabyte-long line does not flood the terminal.
SNIPPET_CHARS = 80


class DataError(ValueError):
    """Training data that zerotrain cannot use; the message names the file, the
    line (1-based) or row where known, and how to fix it."""


def location(path: str | Path, line: int | None = None, unit: str = "line") -> str:
    """``"data/train.jsonl, line 3"``: where a problem is, as messages show it.

    ``unit`` is ``"line"`` for text formats and ``"row"`` for Parquet/Arrow tables,
    both counted from 1 like editors and ``head -n`` do.
    """
    return f"{path}" if line is None else f"{path}, {unit} {line}"


def snippet(text: str) -> str:
    """A quoted excerpt of ``text`` for an error message, cut at ``SNIPPET_CHARS``."""
    text = text.rstrip("\r\n")
    if len(text) > SNIPPET_CHARS:
        text = text[:SNIPPET_CHARS] + "..."
    return repr(text)
