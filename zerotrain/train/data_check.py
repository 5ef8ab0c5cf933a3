"""Whether a run's data gives every rank something to train (and evaluate) on, known before launch.

How many sequences a split packs into is known only once it is tokenized, so `zerotrain train`
tokenizes here, in the launching process, through the cache the ranks then read: a split too
small for the ranks fails once, with its message, before any rank starts, at no cost to the ranks.
"""

from __future__ import annotations

from typing import Any


def check_data_fits(cfg: Any, world_size: int) -> None:
    """DataError when the training split, or (with evaluation on: training.eval_interval above 0)
    the evaluation split, packs into fewer sequences than `world_size` ranks; the same checks, in the
    same words, as each rank's `build_data`. `cfg`: a TrainConfig."""
    from zerotrain.train.data import build_data, load_tokenizer

    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    build_data(cfg.data, tokenizer, world_size=world_size, evaluate=cfg.training.eval_interval > 0)
