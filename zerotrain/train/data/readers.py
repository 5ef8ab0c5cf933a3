"""Readers: each turns one input (see ``sources``) into ``Document``s, streaming.

Format decisions:

* **text** — documents are paragraphs: runs of lines separated by one or more
  blank (whitespace-only) lines.  Newlines inside a paragraph are kept; the
  newline ending its last line is not (the EOS token marks the end instead).
  A file without blank lines is one document.
* **jsonl** — one JSON object per line; blank lines are skipped.  A ``.json``
  file whose first character is ``[`` is read as one JSON array of objects.
* **parquet** — read with ``pyarrow`` in record batches, only the needed columns.
* **arrow** — a ``save_to_disk`` directory loaded with ``datasets.load_from_disk``
  (memory-mapped); for a ``DatasetDict`` the ``"train"`` split.

Records become documents by ``records.document_from_record`` (text field, or
prompt + response).  Every problem is a ``DataError`` naming the file and the
1-based line (row, for tables).  Readers report progress in bytes of input
through an optional callback so one progress bar can span many files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zerotrain.train.data.errors import DataError, location, snippet
from zerotrain.train.data.records import Document, Fields, document_from_record
from zerotrain.train.data.sources import Source

Progress = Callable[[int], None] | None

# Rows per Arrow/Parquet batch: big enough to amortise the Python loop, small
# enough that one batch of long documents stays a few MB.
_TABLE_BATCH = 1024


def read_documents(sources: list[Source], fields: Fields, progress: Progress = None) -> Iterator[Document]:
    """All documents of ``sources``, in order."""
    readers = {"text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "arrow": read_arrow}
    for source in sources:
        yield from readers[source.format](source.path, fields, progress)


def _lines(path: Path, progress: Progress) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) of a UTF-8 file, reporting bytes read.

    Lines are split on bytes and decoded one at a time so a bad byte is reported
    with its line; splitting is safe because no UTF-8 multi-byte sequence contains
    a newline byte.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if progress:
                progress(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{location(path, number)}: not UTF-8 text ({e.reason} at byte {e.start}). "
                    "Convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark is not text
            yield number, line


def _empty(path: Path, what: str) -> DataError:
    return DataError(f"{path}: the file {what}. Remove it from data.path or fill it with training data.")


def read_text(path: Path, fields: Fields, progress: Progress = None) -> Iterator[Document]:
    """Paragraphs of a plain text file, each one document (see the module docstring)."""
    paragraph: list[str] = []
    seen_bytes = found = False
    for _, line in _lines(path, progress):
        seen_bytes = True
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            found = True
            yield Document(text="".join(paragraph).rstrip("\r\n"))
            paragraph = []
    if paragraph:
        found = True
        yield Document(text="".join(paragraph).rstrip("\r\n"))
    if not found:
        raise _empty(path, "has only blank lines" if seen_bytes else "is empty")


def read_jsonl(path: Path, fields: Fields, progress: Progress = None) -> Iterator[Document]:
    """One document per JSON object line (or per element of a ``.json`` array)."""
    if path.suffix.lower() == ".json" and _starts_with_bracket(path):
        yield from _read_json_array(path, fields, progress)
        return
    found = False
    for number, line in _lines(path, progress):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{location(path, number)}: not valid JSON ({e.msg}, column {e.colno}): {snippet(line)}. "
                'Each line of a JSONL file must be one complete JSON object, e.g. {"text": "..."}.'
            ) from None
        found = True
        yield document_from_record(record, fields, str(path), number)
    if not found:
        raise _empty(path, "has no JSON records")


def _starts_with_bracket(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _read_json_array(path: Path, fields: Fields, progress: Progress) -> Iterator[Document]:
    """A ``.json`` file holding one array of records; positions are reported as ``record N``."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            records = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a valid JSON array ({e}). Fix the file or write it as JSONL.") from None
    if progress:
        progress(path.stat().st_size)
    if not isinstance(records, list) or not records:
        raise _empty(path, "holds an empty JSON array" if isinstance(records, list) else "is not a JSON array")
    for number, record in enumerate(records, start=1):
        yield document_from_record(record, fields, str(path), number, unit="record")


def _columns(path: Path, names: list[str], fields: Fields) -> list[str]:
    """The columns a table needs, or a DataError listing the ones it has."""
    wanted = [c for c in (fields.text, fields.prompt, fields.response) if c in names]
    if not wanted:
        raise DataError(
            f"{path}: no column {fields.text!r} and not both {fields.prompt!r} and {fields.response!r} "
            f"(its columns: {', '.join(map(repr, names)) or 'none'}). Set data.text_field, or "
            "data.prompt_field and data.response_field, to the column names."
        )
    return wanted


def _table_rows(path: Path, batches: Iterator[dict[str, list[Any]]], fields: Fields, size: int, total_rows: int,
                progress: Progress) -> Iterator[Document]:
    """Documents from column batches; progress is the file size pro rata of rows read."""
    row = 0
    for batch in batches:
        names = list(batch)
        count = len(batch[names[0]]) if names else 0
        for i in range(count):
            row += 1
            yield document_from_record({n: batch[n][i] for n in names}, fields, str(path), row, unit="row")
        if progress and total_rows:
            progress(size * count // total_rows)
    if row == 0:
        raise _empty(path, "has no rows")


def read_parquet(path: Path, fields: Fields, progress: Progress = None) -> Iterator[Document]:
    """Rows of a Parquet file, read batch by batch with pyarrow (only the needed columns)."""
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: cannot be read as Parquet ({e}). Check the file or set data.format.") from None
    columns = _columns(path, table.schema_arrow.names, fields)
    batches = (b.to_pydict() for b in table.iter_batches(batch_size=_TABLE_BATCH, columns=columns))
    yield from _table_rows(path, batches, fields, path.stat().st_size, table.metadata.num_rows, progress)


def read_arrow(path: Path, fields: Fields, progress: Progress = None) -> Iterator[Document]:
    """Rows of a ``save_to_disk`` directory (the ``"train"`` split of a ``DatasetDict``)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for a bad directory
        raise DataError(f"{path}: cannot be loaded with datasets.load_from_disk ({e}).") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"{path}: the DatasetDict has no 'train' split (its splits: {', '.join(loaded)}). "
                "Save the training split as 'train', or point data.path at that split's directory."
            )
        loaded = loaded["train"]
    columns = _columns(path, loaded.column_names, fields)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())  # as Source.size counts it
    batches = loaded.select_columns(columns).iter(batch_size=_TABLE_BATCH)
    yield from _table_rows(path, batches, fields, size, len(loaded), progress)
