"""Sequence parallelism in `zerotrain train` (training.sequence_parallel_size: N): what the loop changes.

The N consecutive ranks of a sequence group read the same samples (the data is split over the
world / N groups, not over ranks), each feeds the model its 1/N slice of every sequence
(`sequence.shard_batch`: labels shifted before the split, global position_ids), and the loss is
the token-weighted mean over the group's whole sequences (`sequence.loss`): the loss each rank
logs and the gradient are those of sp = 1 on the same global batch. With the chunked loss the
model sums its slice's loss from `shift_labels` (no full logits). Evaluation adds each rank's
slice sums; the all-reduce over the world then counts every token exactly once.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from zerotrain.config.auto import sequence_groups_count
from zerotrain.config.errors import ConfigError
from zerotrain.sequence.attention import SequenceParallelError, check_head_split
from zerotrain.sequence.batch_shard import IGNORE_INDEX, shard_batch
from zerotrain.sequence.groups import SequenceParallelGroups, initialize_sequence_parallel
from zerotrain.sequence.loss import group_token_mean, slice_cross_entropy

KEY = "training.sequence_parallel_size"


def check_sequence_split(cfg: Any, world_size: int) -> None:
    """ConfigError, before any rank starts, unless N = training.sequence_parallel_size divides the
    process count `world_size`, data.seq_len and the model's attention heads (each names the sizes
    that work). `cfg`: a TrainConfig."""
    sp = cfg.training.sequence_parallel_size
    if sp == 1:
        return
    try:
        sequence_groups_count(sp, world_size)
    except ConfigError as error:
        raise ConfigError(f"training.{error} (--nproc_per_node sets the process count)") from None
    seq_len = cfg.data.seq_len
    if seq_len % sp:
        fits = [n for n in range(1, world_size + 1) if world_size % n == 0 and seq_len % n == 0]
        raise ConfigError(
            f"{KEY} {sp} does not divide data.seq_len {seq_len}: each rank holds an equal slice of every sequence. "
            f"Set data.seq_len to a multiple of {sp} (e.g. {-(-seq_len // sp) * sp}), or {KEY} to one of {fits}"
        )
    text = _model_config(cfg.model)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    heads = getattr(text, "num_attention_heads", None)
    if heads:
        try:
            check_head_split(heads, getattr(text, "num_key_value_heads", None) or heads, sp)
        except SequenceParallelError as error:
            raise ConfigError(f"training.{error}") from None


def _model_config(section: Any) -> Any:
    """The Hugging Face config the model section builds (a directory's config.json, read without weights)."""
    from zerotrain.train.model import hf_config_of

    if not section.path:
        return hf_config_of(section)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(section.path, local_files_only=True, trust_remote_code=section.trust_remote_code)


class SequenceSplit:
    """One rank's part of a sequence-parallel run: its slice of each batch and the group's loss.

    `groups`: the layout (`sequence.initialize_sequence_parallel`); `chunked_loss`: the model's
    forward computes the loss from `shift_labels` itself (training.loss_chunk_tokens)."""

    def __init__(self, groups: SequenceParallelGroups, chunked_loss: bool) -> None:
        self.groups = groups
        self.chunked_loss = chunked_loss

    @classmethod
    def start(cls, size: int, chunked_loss: bool) -> "SequenceSplit":
        """Builds the groups of `size` consecutive ranks (a collective: every rank, before the engine,
        which reuses them)."""
        return cls(initialize_sequence_parallel(size), chunked_loss)

    @property
    def data_rank(self) -> int:
        """Which samples this rank reads: its sequence group's index."""
        return self.groups.data_parallel_rank

    @property
    def data_world(self) -> int:
        """How many ways the samples are split: the number of sequence groups."""
        return self.groups.data_parallel_size

    def train_loss(self, engine: Any, batch: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The group's loss on `batch` (the whole micro-batch, as read): this rank's slice forward,
        then the token-weighted mean over the group. Backward through it gives sp = 1's gradient."""
        return group_token_mean(*self._slice_sums(engine, batch, device), self.groups.sequence_group)

    def eval_sums(self, engine: Any, batch: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """[summed loss, target count] of this rank's slice of `batch`, in fp64, to add over the world."""
        total, count = self._slice_sums(engine, batch, device)
        return torch.stack([total.double(), count.double()])

    def _slice_sums(self, engine: Any, batch: Mapping[str, torch.Tensor], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        cut = shard_batch({"input_ids": batch["input_ids"], "labels": batch["labels"]}, self.groups.rank,
                          self.groups.size)
        ids, positions, targets = (cut[k].to(device, non_blocking=True) for k in ("input_ids", "position_ids",
                                                                                 "shift_labels"))
        if self.chunked_loss:  # the chunked loss sums its slice (num_items_in_batch=1), no full logits
            total = engine(input_ids=ids, position_ids=positions, shift_labels=targets, num_items_in_batch=1).loss
            return total, (targets != IGNORE_INDEX).sum()
        return slice_cross_entropy(engine(input_ids=ids, position_ids=positions).logits, targets)
