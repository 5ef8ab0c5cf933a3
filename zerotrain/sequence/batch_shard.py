"""A rank's slice of a batch for sequence parallelism: what each of the N ranks feeds the model.

Every rank of a sequence group holds the same batch (the same samples) and keeps 1/N of its
sequence. What must be settled before the split, because no rank sees the whole row after it:
- `position_ids` are global (0..seq-1 per row, or restarting at each packed document's start),
  so rotary embeddings and the causal/document masks are those of the unsplit sequence;
- labels are shifted first (`shift_labels`: the token each position predicts, -100 after the
  last), so the target of a slice's last token, which lives on the next rank, is not lost;
- the attention mask is dropped, as DeepSpeed's UlyssesSPDataLoaderAdapter effectively does:
  with right padding the causal mask alone is exact (a real token never sees the padding after
  it), provided padded positions predict nothing (-100). Left padding or holes are refused.
A sequence length that N does not divide is refused, not padded: padding here would change the
batch the user gave; a collator's `pad_to_multiple_of=N` pads it before the labels are made.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from zerotrain.sequence.attention import SequenceParallelError

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position: `labels` moved left by one, -100 at the end of every row."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def _check_right_padded(mask: torch.Tensor, targets: torch.Tensor) -> None:
    mask = mask.bool()
    # Right padding: once a row's mask is 0 it stays 0, i.e. the mask never rises.
    rises = (~mask[:, :-1] & mask[:, 1:]).any(dim=1)
    if rises.any():
        rows = rises.nonzero().flatten().tolist()
        raise SequenceParallelError(
            f"attention_mask rows {rows} have padding before real tokens (left padding or holes): sequence "
            "parallelism applies only the causal mask over the whole sequence. Pad on the right "
            "(tokenizer.padding_side = 'right'), or pack documents and mark their starts with position_ids"
        )
    learned = ~mask & (targets != IGNORE_INDEX)
    if learned.any():
        raise SequenceParallelError(
            f"{int(learned.sum())} padded positions (attention_mask 0) have a target other than -100: "
            "set labels to -100 where attention_mask is 0 (DataCollatorForLanguageModeling does), so "
            "padding trains nothing"
        )


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This rank's slice of `batch` (tensors [batch, seq, ...]), for sequence-parallel position `sp_rank`.

    Returns `input_ids`, `position_ids` (global) and `shift_labels` (from `labels`, or as given)
    sliced to seq/N; any other tensor with the same [batch, seq] leading shape is sliced too,
    `attention_mask` is checked and dropped, and non-tensors are passed through. The model must
    compute its loss from `shift_labels` with `sequence.loss.sequence_parallel_loss`.
    """
    ids = batch["input_ids"]
    rows, seq = ids.shape[0], ids.shape[1]
    if seq % sp_size:
        multiple = -(-seq // sp_size) * sp_size
        raise SequenceParallelError(
            f"sequence length {seq} is not divisible by sequence_parallel_size {sp_size}: every rank must hold "
            f"an equal slice. Pad the batch to a multiple of {sp_size} (e.g. {multiple}; a collator's "
            f"pad_to_multiple_of={sp_size}, with labels -100 on the padding)"
        )
    if "shift_labels" in batch:
        targets = batch["shift_labels"]
    elif "labels" in batch:
        targets = shift_labels(batch["labels"])
    else:
        raise SequenceParallelError(
            "the batch has neither labels nor shift_labels: a sequence-parallel loss needs the targets "
            "before the sequence is split"
        )
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(rows, seq)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        _check_right_padded(mask, targets)
    chunk = seq // sp_size
    piece = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name in ("labels", "shift_labels", "attention_mask", "position_ids"):
            continue
        is_sequence = torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == ids.shape[:2]
        out[name] = value[:, piece].contiguous() if is_sequence else value
    out["position_ids"] = positions.expand(rows, seq)[:, piece].contiguous()
    out["shift_labels"] = targets[:, piece].contiguous()
    return out
