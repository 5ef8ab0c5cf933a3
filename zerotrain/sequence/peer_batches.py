"""Sequence parallelism over a data loader that gives every rank its own batch (DeepSpeed's
`UlyssesSPDataLoaderAdapter`, which Accelerate wraps around the Trainer's loader).

Accelerate shards the data over the whole world, so the N ranks of a sequence group read N
different batches. Each refill gathers the N batches over the group, and the group then trains them
one after the other, every rank holding its slice of each (`shard_batch`: labels shifted on the full
sequence, global position_ids). N micro-batches per batch read: the loader's length is len * N.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

import torch
import torch.distributed as dist

from zerotrain.sequence.batch_shard import shard_batch


class PeerBatchLoader:
    """Iterates the slices of the sequence group's batches: peer 0's batch, then peer 1's, ...

    `loader`: this rank's batches (dicts with `input_ids`, `position_ids` and `labels` or
    `shift_labels`, tensors [batch, seq]). `device`: where the gather runs (the group's backend
    device); the slices are returned on the CPU, as DeepSpeed does (the Trainer moves them).
    """

    def __init__(self, loader: Iterable, sp_rank: int, sp_group, sp_world_size: int, device: Any = "cpu") -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = loader, sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if not isinstance(device, torch.device) else device
        self.iter = iter(loader)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "PeerBatchLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Reads this rank's next batch and queues the slices of every peer's batch. At the end of
        the loader it restarts the iterator and raises StopIteration (one epoch ends, the next can begin)."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses sequence parallelism needs `position_ids` in every batch, so each token keeps its global "
                "position after the sequence is split: arange(seq_len) per row, restarting at each packed "
                "document. Make the data collator return them (DataCollatorForLanguageModeling(..., "
                "return_position_ids=True); TRL's SFTTrainer sets it)"
            )
        for peer_batch in self._gather(batch):
            self.micro_batches.append(_to_cpu(shard_batch(peer_batch, self.sp_rank, self.sp_world_size)))

    def _gather(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The N batches of the group, in peer order (sequence lengths may differ between peers)."""
        n, ids = self.sp_world_size, batch["input_ids"]
        # Gloo checks gather shapes strictly: a 1-element tensor, not a 0-d one.
        length = torch.tensor([ids.shape[1]], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(n)]
        dist.all_gather(lengths, length, group=self.sp_group)
        peers: list[dict[str, Any]] = [{} for _ in range(n)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                if value.dim() < 2 or value.shape[1] != ids.shape[1]:
                    raise ValueError(
                        f"batch[{key!r}] has shape {tuple(value.shape)}; sequence parallelism splits every tensor of "
                        f"the batch along the sequence, so it must be [batch, {ids.shape[1]}] like input_ids"
                    )
                value = value.to(self.device)
                parts = [value.new_zeros((value.shape[0], int(seq), *value.shape[2:])) for seq in lengths]
                dist.all_gather(parts, value.contiguous(), group=self.sp_group)
            else:
                parts = [None] * n
                dist.all_gather_object(parts, value, group=self.sp_group)
            for peer, part in zip(peers, parts):
                peer[key] = part
        return peers


def _to_cpu(batch: dict[str, Any]) -> dict[str, Any]:
    # Long sequences on many ranks make these buffers large: keep the queue off the accelerator.
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
