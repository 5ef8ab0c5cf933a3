"""Tokenized documents, stored compactly: one token array plus two small per-document arrays.

A document becomes ``[BOS] + prompt + text + [EOS]``:

* BOS only when the tokenizer has one distinct from EOS (Llama, Mistral, the byte
  tokenizer).  GPT-2-style tokenizers use one token for both, and Qwen-style ones
  none: for them documents are separated by EOS alone, as in their pretraining.
* EOS always ends a document, so packing can concatenate documents and the
  model learns where one stops.

The loss mask of a document is always a prefix (BOS and prompt are masked,
text and EOS are trained on), so instead of a mask per token the corpus keeps
one count per document: ``doc_masked[i]`` tokens at the start of document ``i``
carry no loss.  That keeps the cache at 2 or 4 bytes per token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.train.data.errors import DataError
from zerotrain.train.data.records import Document

# Documents tokenized per call: fast tokenizers parallelise within a batch.
_TOKENIZE_BATCH = 1000

_ARRAYS = ("tokens", "doc_offsets", "doc_masked")


@dataclass
class TokenizedCorpus:
    """All documents' tokens back to back.

    ``tokens[doc_offsets[i]:doc_offsets[i + 1]]`` is document ``i``; its first
    ``doc_masked[i]`` tokens are masked from the loss.  ``tokens`` may be a
    read-only memory map of the cache file.
    """

    tokens: np.ndarray
    doc_offsets: np.ndarray  # int64, num_documents + 1 entries, starting at 0
    doc_masked: np.ndarray  # int32, num_documents entries

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    def save(self, directory: Path, meta: dict[str, Any]) -> None:
        """Writes the arrays as ``.npy`` (never pickle) and ``meta.json`` into ``directory``."""
        for name in _ARRAYS:
            np.save(directory / f"{name}.npy", np.ascontiguousarray(getattr(self, name)), allow_pickle=False)
        (directory / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))

    @classmethod
    def load(cls, directory: Path) -> "TokenizedCorpus":
        """Reads a saved corpus; the token array is memory-mapped, not read into memory."""
        tokens = np.load(directory / "tokens.npy", mmap_mode="r", allow_pickle=False)
        offsets = np.load(directory / "doc_offsets.npy", allow_pickle=False)
        masked = np.load(directory / "doc_masked.npy", allow_pickle=False)
        return cls(tokens=tokens, doc_offsets=offsets, doc_masked=masked)


def special_ids(tokenizer: Any) -> tuple[int | None, int]:
    """(BOS id or None, EOS id) as documents use them; a DataError if there is no EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no end-of-sequence token; packed "
            "documents are separated by it. Set eos_token in its tokenizer_config.json, or use 'byte'."
        )
    bos = tokenizer.bos_token_id
    return (bos if bos is not None and bos != eos else None), eos


def token_dtype(tokenizer: Any) -> np.dtype:
    """The smallest unsigned type holding every id: 2 bytes per token up to 65 536 ids."""
    return np.dtype(np.uint16 if len(tokenizer) <= 2**16 else np.uint32)


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    # verbose=False: documents longer than model_max_length are fine here (packing
    # cuts them), so the "sequence length is longer than" warning would only alarm.
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def tokenize_documents(documents: Iterable[Document], tokenizer: Any) -> TokenizedCorpus:
    """Tokenizes ``documents`` (in order) into a corpus; empty documents are skipped."""
    bos, eos = special_ids(tokenizer)
    dtype = token_dtype(tokenizer)
    head = [bos] if bos is not None else []
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    masked: list[int] = []
    batch: list[Document] = []

    def flush() -> None:
        texts = _encode(tokenizer, [d.text for d in batch])
        prompted = [i for i, d in enumerate(batch) if d.prompt]
        prompts = dict(zip(prompted, _encode(tokenizer, [batch[i].prompt for i in prompted])))
        flat: list[int] = []
        for i, text_ids in enumerate(texts):
            prompt_ids = prompts.get(i, [])
            flat += head + prompt_ids + text_ids + [eos]
            lengths.append(len(head) + len(prompt_ids) + len(text_ids) + 1)
            masked.append(len(head) + len(prompt_ids))
        pieces.append(np.asarray(flat, dtype=dtype))
        batch.clear()

    for document in documents:
        if document.text or document.prompt:
            batch.append(document)
            if len(batch) == _TOKENIZE_BATCH:
                flush()
    if batch:
        flush()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return TokenizedCorpus(tokens=tokens, doc_offsets=offsets, doc_masked=np.asarray(masked, dtype=np.int32))
