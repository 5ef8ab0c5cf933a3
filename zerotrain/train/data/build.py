"""``build_data``: from the ``data`` config section to packed train/eval datasets.

The one function the trainer calls; see the package docstring for its contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.train.data.batches import EvalBatches, RankBatches
from zerotrain.train.data.cache import cached_corpus, default_cache_root
from zerotrain.train.data.corpus import TokenizedCorpus, special_ids
from zerotrain.train.data.errors import DataError
from zerotrain.train.data.packing import PackedDataset
from zerotrain.train.data.readers import read_documents
from zerotrain.train.data.records import Fields
from zerotrain.train.data.sources import check_format, fingerprint, resolve_sources
from zerotrain.train.data.synthetic import SyntheticExample, synthetic_examples

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    """What ``build_data`` returns: the datasets plus what the trainer needs to batch them."""

    train: PackedDataset
    eval: PackedDataset | None
    tokens_per_sample: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    # Held-out synthetic examples, for `synthetic_answer_accuracy`; None for file data.
    eval_examples: list[SyntheticExample] | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def train_batches(self, micro_batch_size: int, seed: int | None = None) -> RankBatches:
        """This rank's endless, resumable training micro-batches, shuffled by ``seed`` (default: data.seed)."""
        seed = self.seed if seed is None else seed
        return RankBatches(self.train, micro_batch_size, rank=self.rank, world_size=self.world_size, seed=seed)

    def eval_batches(self, micro_batch_size: int, max_batches: int | None = None) -> EvalBatches | None:
        """This rank's evaluation micro-batches, or None without eval data."""
        if self.eval is None:
            return None
        return EvalBatches(self.eval, micro_batch_size, rank=self.rank, world_size=self.world_size,
                           max_batches=max_batches)


def _option(cfg: Any, name: str, default: Any) -> Any:
    """``cfg.name``, or ``default`` when absent or None: works for pydantic models and namespaces alike."""
    value = getattr(cfg, name, None)
    return default if value is None else value


def split_documents(num_documents: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, each sorted: a random ``fraction`` (at least one) held out.

    Deterministic in ``seed``, so every rank and every resumed run holds out the same documents.
    """
    if not 0 <= fraction < 1:
        raise DataError(f"data.eval_fraction must be in [0, 1), got {fraction}.")
    n_eval = max(1, round(num_documents * fraction)) if fraction > 0 else 0
    if n_eval and n_eval >= num_documents:
        raise DataError(
            f"the data has {num_documents} document(s), too few to hold out data.eval_fraction={fraction} "
            "for evaluation. Give data.eval_path, set data.eval_fraction: 0, or add documents "
            "(plain text files are split into documents at blank lines)."
        )
    order = np.random.default_rng(seed).permutation(num_documents)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def build_data(data_cfg: Any, tokenizer: Any, *, max_positions: int | None = None, rank: int = 0,
               world_size: int = 1, evaluate: bool = True) -> TrainData:
    """Reads, tokenizes (through the cache), splits and packs the data of ``data_cfg``.

    DataError when a split packs into fewer sequences than ``world_size`` ranks. ``evaluate`` False
    (training.eval_interval 0): no evaluation split is built or checked (``eval_path`` is not read);
    an ``eval_fraction`` is still held out, so the training data is the same whether a run evaluates
    or not (a resume that switches evaluation on keeps its place in the data).
    """
    seq_len = int(_option(data_cfg, "seq_len", 256))
    if max_positions is not None and seq_len > max_positions:
        raise DataError(
            f"data.seq_len is {seq_len} but the model has only {max_positions} positions "
            f"(max_position_embeddings). Set data.seq_len to {max_positions} or less."
        )
    check_data_sources(data_cfg, evaluate=evaluate)
    fmt = check_format(_option(data_cfg, "format", "auto"))
    path = _option(data_cfg, "path", None)
    seed = int(_option(data_cfg, "seed", 0))
    fraction = float(_option(data_cfg, "eval_fraction", 0.05))
    eval_path = _option(data_cfg, "eval_path", None)
    cache_root = Path(_option(data_cfg, "cache_dir", None) or default_cache_root()).expanduser()
    fields = Fields.from_config(data_cfg)
    common = dict(tokenizer=tokenizer, cache_root=cache_root, rank=rank, world_size=world_size)

    examples: list[SyntheticExample] | None = None
    if fmt == "synthetic" or path is None:
        syn = _option(data_cfg, "synthetic", None)
        task = _option(syn, "task", "arithmetic")
        num, syn_seed = int(_option(syn, "num_examples", 20000)), int(_option(syn, "seed", 0))
        examples = synthetic_examples(task, num, syn_seed)
        identity = {"synthetic": {"task": task, "num_examples": num, "seed": syn_seed}}
        source_desc = f"synthetic {task} ({num} examples)"
        corpus = cached_corpus(identity, lambda progress: (e.document for e in examples), total_documents=num,
                               label=source_desc, **common)
    else:
        corpus = _file_corpus(path, fmt, fields, "data.path", common)
        source_desc = str(path)

    _, eos = special_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    eval_examples = None
    evaluation: PackedDataset | None = None
    if eval_path is not None:
        train = PackedDataset(corpus, seq_len, pad)
        if evaluate:
            eval_fmt = "auto" if fmt == "synthetic" else fmt
            evaluation = PackedDataset(_file_corpus(eval_path, eval_fmt, fields, "data.eval_path", common), seq_len, pad)
    elif fraction > 0:
        train_docs, eval_docs = split_documents(corpus.num_documents, fraction, seed)
        train = PackedDataset(corpus, seq_len, pad, train_docs)
        if evaluate:
            evaluation = PackedDataset(corpus, seq_len, pad, eval_docs)
        if examples is not None:  # synthetic documents are never empty: document i is example i
            eval_examples = [examples[i] for i in eval_docs]
    else:
        train = PackedDataset(corpus, seq_len, pad)

    _check_enough(train, "training", world_size, "data.path")
    if evaluation is not None:
        _check_enough(evaluation, "eval", world_size, "data.eval_path or data.eval_fraction",
                      " Or set training.eval_interval: 0 to train without evaluating.")
    summary = {
        "source": source_desc,
        "train_sequences": len(train),
        "train_tokens": train.num_tokens,
        "eval_sequences": len(evaluation) if evaluation is not None else 0,
        "seq_len": seq_len,
    }
    if rank == 0:
        log.info("data: %s -> %s", source_desc, summary)
    return TrainData(train=train, eval=evaluation, tokens_per_sample=seq_len, seed=seed, rank=rank,
                     world_size=world_size, eval_examples=eval_examples, summary=summary)


def check_data_sources(data_cfg: Any, records: int = 3, *, evaluate: bool = True) -> None:
    """DataError for what can be checked of the data before any rank starts: the format and path
    agree, every file exists, and the first `records` records of the first file read as
    configured (fields, JSON, UTF-8); ``data.eval_path`` too unless ``evaluate`` is False (a run
    that never evaluates never reads it). `zerotrain train` runs it in the launching process."""
    fmt = check_format(_option(data_cfg, "format", "auto"))
    path = _option(data_cfg, "path", None)
    if fmt == "synthetic" or path is None:
        if fmt not in ("auto", "synthetic"):
            raise DataError(f"data.format is {fmt!r} but data.path is not set. Set data.path to the data.")
        if path is not None:
            raise DataError(
                f"data.path is {path!r} but data.format is 'synthetic' (the generated task): set data.format "
                "to auto (or text/jsonl/parquet/arrow) to train on the file, or remove data.path"
            )
    fields = Fields.from_config(data_cfg)
    eval_path = _option(data_cfg, "eval_path", None) if evaluate else None
    for key, where, how in (("data.path", path, fmt), ("data.eval_path", eval_path, "auto" if fmt == "synthetic" else fmt)):
        if where is None or how == "synthetic":
            continue
        sources = resolve_sources(where, how, key)
        for _ in zip(range(records), read_documents(sources[:1], fields)):
            pass


def _file_corpus(path: Any, fmt: str, fields: Fields, key: str, common: dict[str, Any]) -> TokenizedCorpus:
    """The cached corpus of the files under ``path``."""
    sources = resolve_sources(path, fmt, key)
    identity = {
        "files": fingerprint(sources),
        "formats": [s.format for s in sources],
        "fields": [fields.text, fields.prompt, fields.response],
    }
    total = sum(s.size for s in sources)
    return cached_corpus(identity, lambda progress: read_documents(sources, fields, progress), total_bytes=total,
                         label=str(path), **common)


def _check_enough(dataset: PackedDataset, what: str, world_size: int, key: str, other_fix: str = "") -> None:
    """Every rank needs at least one sequence; say so clearly instead of failing in the loop."""
    if len(dataset) < world_size:
        raise DataError(
            f"the {what} data packs into {len(dataset)} sequence(s) of data.seq_len={dataset.seq_len} tokens "
            f"({dataset.num_tokens} tokens), fewer than the {world_size} rank(s). Add data ({key}) or lower "
            f"data.seq_len.{other_fix}"
        )
