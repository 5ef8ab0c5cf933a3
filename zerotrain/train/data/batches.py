"""Which samples each rank trains on, micro-batch by micro-batch, resumable exactly.

Every epoch draws a permutation of all sample indices from ``(seed, epoch)`` —
the same on every rank, no communication needed.  The permutation is read in
global steps of ``world_size * micro_batch_size`` samples; in each step rank
``r`` takes the ``r``-th block of ``micro_batch_size``.  Ranks therefore see
disjoint samples, all the same number of micro-batches, and together all the
samples except the last ``len % (world_size * micro_batch_size)`` of each
permutation (a different remainder each epoch).

``RankBatches.state_dict()`` is ``(epoch, micro-batches consumed in it)``; a
resumed run that loads it continues with exactly the batches the interrupted
run would have drawn next.  Resuming with another world size or micro-batch
size continues after the same number of samples (rounded down to a whole
global step) of the same permutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.data.errors import DataError


def _collate(dataset: Dataset, indices: np.ndarray) -> dict[str, torch.Tensor]:
    samples = [dataset[int(i)] for i in indices]
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class RankBatches:
    """An endless iterator of this rank's training micro-batches, epoch after epoch.

    Each batch is ``{"input_ids": LongTensor[B, seq_len], "labels": LongTensor[B, seq_len]}``.
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0):
        if micro_batch_size < 1:
            raise DataError(f"the micro-batch size must be at least 1, got {micro_batch_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step_samples = world_size * micro_batch_size
        self.batches_per_epoch = len(dataset) // self.step_samples
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the training data packs into {len(dataset)} sequences, fewer than one micro-batch of "
                f"{micro_batch_size} for each of {world_size} ranks ({self.step_samples}). Add data, lower "
                "data.seq_len or the micro-batch size."
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: np.ndarray | None = None  # permutation of the current epoch, drawn lazily

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``: identical on every rank and in every run."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def indices(self, epoch: int, batch: int) -> np.ndarray:
        """Sample indices of this rank's ``batch``-th micro-batch of ``epoch``."""
        order = self._order if self._order is not None and epoch == self.epoch else self.permutation(epoch)
        begin = batch * self.step_samples + self.rank * self.micro_batch_size
        return order[begin:begin + self.micro_batch_size]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        if self._order is None:
            self._order = self.permutation(self.epoch)
        batch = _collate(self.dataset, self.indices(self.epoch, self.batch_in_epoch))
        self.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the iterator stands; plain ints, safe for JSON and ``torch.save``."""
        return {
            "epoch": self.epoch,
            "micro_batches": self.batch_in_epoch,
            "samples": len(self.dataset),
            "seed": self.seed,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues where ``state`` stood; a DataError if the data changed underneath.

        An empty ``state`` (a checkpoint from before any batch was drawn) means the start.
        """
        if not state:
            self.epoch, self.batch_in_epoch, self._order = 0, 0, None
            return
        if state.get("samples", len(self.dataset)) != len(self.dataset) or state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"cannot resume the data order: the checkpoint's data had {state.get('samples')} sequences "
                f"with seed {state.get('seed')}, this run has {len(self.dataset)} with seed {self.seed}. "
                "Resume with the same data, data.seq_len and data.seed."
            )
        consumed = state["micro_batches"] * state.get("world_size", self.world_size) * state.get(
            "micro_batch_size", self.micro_batch_size)
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = min(consumed // self.step_samples, self.batches_per_epoch)
        self._order = None

    def skip_samples(self, samples: int) -> None:
        """Continues after the first ``samples`` samples of this order (rounded down to a whole global
        step), where a run that had trained on them would stand: for a run whose own position is not
        known (a DeepSpeed run's global_samples)."""
        self.epoch, within = divmod(int(samples), self.batches_per_epoch * self.step_samples)
        self.batch_in_epoch = within // self.step_samples
        self._order = None

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return self.batches_per_epoch


class EvalBatches:
    """This rank's evaluation micro-batches, in order (no shuffle), re-iterable.

    Rank ``r`` takes every ``world_size``-th sequence starting at ``r``, after
    dropping the last ``len % world_size`` so every rank runs the same number of
    forward passes (ZeRO-3 ranks must).  The last micro-batch may be smaller.
    ``max_batches`` caps the micro-batches per rank.
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, *, rank: int = 0, world_size: int = 1,
                 max_batches: int | None = None):
        if micro_batch_size < 1:
            raise DataError(f"the micro-batch size must be at least 1, got {micro_batch_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        usable = len(dataset) - len(dataset) % world_size
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self._indices = np.arange(rank, usable, world_size)
        count = -(-len(self._indices) // micro_batch_size)
        self.num_batches = count if max_batches is None else min(count, max_batches)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in range(self.num_batches):
            yield _collate(self.dataset, self._indices[b * self.micro_batch_size:(b + 1) * self.micro_batch_size])
