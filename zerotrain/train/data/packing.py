"""Packing: documents back to back, cut into training sequences of exactly ``seq_len`` tokens.

Packing wastes no compute on padding: a sequence may end one document and start
the next (they are separated by EOS, see ``corpus``).  Only the last sequence
is short; it is padded to ``seq_len`` with labels -100 so no token is dropped,
which matters for small eval sets.

Labels are the input ids with -100 where there is no loss (BOS, prompts, padding).
They are *not* shifted: Hugging Face causal LMs shift them inside ``forward``, so
``labels[0]`` is never used.  A sequence whose labels after the first are all
-100 (possible inside a prompt longer than ``seq_len``) is left out: its loss
would be 0/0.

A ``PackedDataset`` can use a subset of a corpus' documents (the train or eval
split) without copying tokens: positions in the virtual concatenation of the
chosen documents map back to the corpus' token array by binary search.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.data.corpus import TokenizedCorpus
from zerotrain.train.data.errors import DataError

IGNORE_INDEX = -100


class PackedDataset(Dataset):
    """Fixed-length samples ``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``.

    ``documents`` selects (and orders) the corpus documents to pack; all of them by default.
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, pad_id: int, documents: np.ndarray | None = None):
        if seq_len < 2:
            raise DataError(f"data.seq_len must be at least 2 (one input and one target), got {seq_len}.")
        self.corpus = corpus
        self.seq_len = seq_len
        self.pad_id = pad_id
        docs = np.arange(corpus.num_documents) if documents is None else np.asarray(documents, dtype=np.int64)
        self.num_documents = len(docs)
        self._doc_start = corpus.doc_offsets[docs]  # where each chosen document starts in corpus.tokens
        self._doc_masked = corpus.doc_masked[docs].astype(np.int64)
        lengths = corpus.doc_offsets[docs + 1] - self._doc_start
        # _virtual[j]: where chosen document j starts in the packed stream; _virtual[-1] is its length.
        self._virtual = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._virtual[1:])
        self.num_tokens = int(self._virtual[-1])
        starts = np.arange(0, self.num_tokens, seq_len, dtype=np.int64)
        self._starts = starts[self._has_targets(starts)]

    def _has_targets(self, starts: np.ndarray) -> np.ndarray:
        """For each sequence start, whether some label after the first is trained on.

        Every document ends with a trained EOS, so a sequence whose positions
        1..end all carry no loss lies inside the masked prefix of the one
        document that holds position 1.
        """
        ends = np.minimum(starts + self.seq_len, self.num_tokens)  # exclusive
        first = starts + 1
        has = ends > first
        doc = np.searchsorted(self._virtual, np.minimum(first, self.num_tokens - 1), side="right") - 1
        inside_prompt = (ends - 1 - self._virtual[doc]) < self._doc_masked[doc]
        return has & ~inside_prompt

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self._starts[index])
        positions = np.arange(start, min(start + self.seq_len, self.num_tokens), dtype=np.int64)
        doc = np.searchsorted(self._virtual, positions, side="right") - 1
        local = positions - self._virtual[doc]
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        n = len(positions)
        ids[:n] = self.corpus.tokens[self._doc_start[doc] + local]
        labels[:n] = np.where(local < self._doc_masked[doc], IGNORE_INDEX, ids[:n])
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def __repr__(self) -> str:
        return (f"PackedDataset({len(self)} sequences of {self.seq_len} tokens from "
                f"{self.num_documents} documents, {self.num_tokens} tokens)")
