"""Tokenize once, reuse forever: a content-keyed on-disk cache of ``TokenizedCorpus``es.

The key hashes everything the token ids depend on: the input files (paths,
sizes, modification times) or the synthetic task's parameters, the format,
the field names, and the tokenizer's identity (``tokenizer_fingerprint``).
``seq_len``, the seed and the eval split are *not* in the key: packing and
splitting happen after loading, so changing them reuses the cache.

Entries are directories ``<cache root>/<key>/`` written under a temporary name
and renamed into place, so a reader sees a complete entry or none, and
processes racing to build the same entry cannot corrupt it (the loser discards
its copy).  In a distributed job rank 0 builds while the others wait at a
barrier; a rank that still finds no entry afterwards (a cache directory that
is not shared between nodes) builds its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from zerotrain.system.durable_files import rename_durably, temp_path_for
from zerotrain.train.data.corpus import TokenizedCorpus, tokenize_documents
from zerotrain.train.data.records import Document
from zerotrain.train.data.tokenize_progress import TokenizeProgress
from zerotrain.train.data.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

# Bump when the stored layout or the tokenization rules change: old entries then miss.
CACHE_VERSION = 1

Reader = Callable[[Callable[[int], None] | None], Iterable[Document]]


def default_cache_root() -> Path:
    """``$ZEROTRAIN_CACHE/data`` if that variable is set, else ``~/.cache/zerotrain/data``."""
    root = os.environ.get("ZEROTRAIN_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "zerotrain") / "data"


def cache_key(identity: dict[str, Any], tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """(key, what it was computed from) for data ``identity`` tokenized by ``tokenizer``.

    The tokenizer's ``name_or_path`` is kept for people reading ``meta.json`` but
    left out of the hash: the same tokenizer loaded from another directory (a
    checkpoint's copy, say) gives the same ids, and its definition hash already
    changes whenever the vocabulary, merges or specials do.
    """
    tok = tokenizer_fingerprint(tokenizer)
    tok_identity = {k: v for k, v in tok.items() if k != "name_or_path"}
    hashed = {"version": CACHE_VERSION, "data": identity, "tokenizer": tok_identity}
    key = hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return key, {**hashed, "tokenizer": tok}


def cached_corpus(identity: dict[str, Any], read: Reader, tokenizer: Any, *, cache_root: Path,
                  total_bytes: int = 0, total_documents: int | None = None, label: str = "data",
                  rank: int = 0, world_size: int = 1) -> TokenizedCorpus:
    """The corpus for ``identity``, from the cache or built by tokenizing ``read(progress)``.

    ``read`` is called with a progress callback (bytes of input consumed, or None)
    and yields the documents.  When ``torch.distributed`` is initialized with more
    than one rank, rank 0 builds and the others wait for it at a barrier.  Rank 0
    shows the progress (``label`` names the input; ``total_bytes`` or
    ``total_documents`` sets the scale when known).
    """
    size = {"total_bytes": total_bytes, "total_documents": total_documents, "label": label}
    key, meta = cache_key(identity, tokenizer)
    entry = Path(cache_root).expanduser() / key
    if _distributed(world_size):
        import torch.distributed as dist

        try:
            if rank == 0 and not entry.is_dir():
                _build(entry, meta, read, tokenizer, size, show_progress=True)
        finally:
            # Reached even when rank 0 fails (e.g. a DataError), so the others do
            # not hang: they find no entry and fail on the same data themselves.
            dist.barrier()
    if not entry.is_dir():
        _build(entry, meta, read, tokenizer, size, show_progress=rank == 0)
    return TokenizedCorpus.load(entry)


def _distributed(world_size: int) -> bool:
    if world_size <= 1:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _build(entry: Path, meta: dict[str, Any], read: Reader, tokenizer: Any, size: dict[str, Any],
           show_progress: bool) -> None:
    """Tokenizes and writes ``entry`` atomically (temporary directory, then rename)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with TokenizeProgress(size["label"], total_bytes=size["total_bytes"], total_documents=size["total_documents"],
                          enabled=show_progress) as progress:
        corpus = tokenize_documents(_counted(read(progress.advance_bytes), progress), tokenizer)
    temp = temp_path_for(entry)
    temp.mkdir()
    try:
        corpus.save(temp, {**meta, "num_documents": corpus.num_documents, "num_tokens": corpus.num_tokens})
        rename_durably(temp, entry)
    except OSError:
        if not entry.is_dir():
            raise
        # Another process renamed its identical copy into place first: keep that one.
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    progress.finish(corpus.num_documents, corpus.num_tokens)
    log.debug("tokenized %d documents (%d tokens) in %.1fs into %s", corpus.num_documents, corpus.num_tokens,
              time.perf_counter() - started, entry)


def _counted(documents: Iterable[Document], progress: TokenizeProgress) -> Iterable[Document]:
    for document in documents:
        progress.count_document()
        yield document
