"""Training data for ``zerotrain train``: read, tokenize once, pack, and batch per rank.

The trainer calls::

    tokenizer = load_tokenizer(spec, model_path, trust_remote_code=False)
    data = build_data(data_cfg, tokenizer, *, max_positions=None, rank=0, world_size=1) -> TrainData

    data.train              # PackedDataset: {"input_ids", "labels"} LongTensor[seq_len] samples
    data.eval               # PackedDataset or None
    data.tokens_per_sample  # == data.seq_len
    data.eval_examples      # held-out SyntheticExamples (synthetic data only), else None
    batches = data.train_batches(micro_batch_size, seed=None)  # RankBatches: endless, resumable
    batches.state_dict() / batches.load_state_dict(state)
    data.eval_batches(micro_batch_size, max_batches)  # EvalBatches or None

``data_cfg`` is any object with these attributes (missing or None ones take the default):
``path`` (file or directory; None = synthetic), ``format`` ("auto", "text", "jsonl",
"parquet", "arrow", "synthetic"), ``text_field``, ``prompt_field``, ``response_field``,
``seq_len``, ``eval_path``, ``eval_fraction``, ``seed``, ``cache_dir`` and ``synthetic``
(with ``task``, ``num_examples``, ``seed``).

Every problem with the data is a ``DataError`` (a ``ValueError``) naming the file,
the line and what to change.  Module map: ``sources`` (which files, which format),
``readers`` (files -> documents), ``records`` (record -> document), ``synthetic``,
``tokenizer``, ``corpus`` (documents -> token ids), ``cache`` (tokenize once),
``packing`` (ids -> fixed-length samples), ``batches`` (samples -> per-rank
micro-batches), ``build`` (all of it from the config).
"""

from zerotrain.train.data.batches import EvalBatches, RankBatches
from zerotrain.train.data.build import TrainData, build_data, split_documents
from zerotrain.train.data.cache import default_cache_root
from zerotrain.train.data.corpus import TokenizedCorpus, tokenize_documents
from zerotrain.train.data.errors import DataError
from zerotrain.train.data.packing import IGNORE_INDEX, PackedDataset
from zerotrain.train.data.readers import read_documents
from zerotrain.train.data.records import Document, Fields
from zerotrain.train.data.sources import FORMATS, resolve_sources
from zerotrain.train.data.synthetic import SyntheticExample, synthetic_answer_accuracy, synthetic_examples
from zerotrain.train.data.tokenizer import byte_tokenizer, load_tokenizer

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "DataError",
    "Document",
    "EvalBatches",
    "Fields",
    "PackedDataset",
    "RankBatches",
    "SyntheticExample",
    "TokenizedCorpus",
    "TrainData",
    "build_data",
    "byte_tokenizer",
    "default_cache_root",
    "load_tokenizer",
    "read_documents",
    "resolve_sources",
    "split_documents",
    "synthetic_answer_accuracy",
    "synthetic_examples",
    "tokenize_documents",
]
