"""The evaluation loss of `zerotrain train`: token-weighted over the held-out split, across every rank.

Each rank adds [summed loss, target count] over its evaluation batches and one all-reduce adds
the ranks', so a rank with more targets weighs more, as one process evaluating everything would.
With sequence parallelism each rank adds its slice's sums (`sequence_split.py`): every token once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


@torch.no_grad()
def held_out_loss(engine: Any, batches: Iterable[dict], device: torch.device, split: Any = None,
                  at_batch: Callable[[], None] | None = None) -> float:
    """The mean next-token loss over every target of `batches` on every rank (a collective).
    `split`: the run's SequenceSplit, if sequence-parallel; `at_batch`: called before each batch
    (the hang watch: evaluating is progress too)."""
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        if at_batch is not None:
            at_batch()
        totals += split.eval_sums(engine, batch, device) if split is not None else _batch_sums(engine, batch, device)
    engine.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1))


def _batch_sums(engine: Any, batch: dict, device: torch.device) -> torch.Tensor:
    labels = batch["labels"].to(device)
    loss = engine(input_ids=batch["input_ids"].to(device), labels=labels).loss
    tokens = (labels[:, 1:] != IGNORE_INDEX).sum()  # the model shifts labels by one
    return torch.stack([loss.double() * tokens, tokens.double()])
