"""A training document and how a record (a JSON object or a table row) becomes one.

Every reader yields ``Document``s so that tokenization, caching and packing never
look at formats.  A document is trained on whole (``prompt`` empty) or, for
instruction data, only on its response: the prompt is context the model sees but
is not asked to predict, so its labels are masked with -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotrain.train.data.errors import DataError, location


@dataclass(frozen=True)
class Document:
    """One training document: loss on ``text``; ``prompt`` (may be empty) is masked context before it."""

    text: str
    prompt: str = ""


@dataclass(frozen=True)
class Fields:
    """Which record fields hold the data (``data.text_field``, ``data.prompt_field``, ``data.response_field``)."""

    text: str = "text"
    prompt: str = "prompt"
    response: str = "response"

    @classmethod
    def from_config(cls, cfg: Any) -> "Fields":
        """Reads the three field names from a config section (any object with those attributes)."""
        return cls(
            text=getattr(cfg, "text_field", None) or "text",
            prompt=getattr(cfg, "prompt_field", None) or "prompt",
            response=getattr(cfg, "response_field", None) or "response",
        )


def document_from_record(record: Any, fields: Fields, path: str, line: int, unit: str = "line") -> Document:
    """Turns one record into a ``Document``; a ``DataError`` names ``path``/``line`` when it cannot.

    A record with both the prompt and the response field is instruction data
    (loss on the response only); otherwise it must have the text field.  Fields
    present with a null value count as absent, so a table mixing both kinds of
    rows (nulls in the unused columns) works.
    """
    where = location(path, line, unit)
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object like {{{fields.text!r}: \"...\"}}, got {type(record).__name__}. "
            "Each line of a JSONL file must be one object."
        )
    prompt, response = record.get(fields.prompt), record.get(fields.response)
    if prompt is not None and response is not None:
        return Document(text=_string(response, fields.response, where), prompt=_string(prompt, fields.prompt, where))
    text = record.get(fields.text)
    if text is not None:
        return Document(text=_string(text, fields.text, where))
    present = ", ".join(repr(k) for k in record) or "none"
    raise DataError(
        f"{where}: the record has no {fields.text!r} field and not both {fields.prompt!r} and "
        f"{fields.response!r} (its fields: {present}). Set data.text_field to the field holding the "
        "text, or data.prompt_field and data.response_field for prompt/response pairs."
    )


def _string(value: Any, field: str, where: str) -> str:
    """The field's value, which must be a string: numbers or lists are a mistake, not text."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__} ({value!r:.60}).")
    return value
