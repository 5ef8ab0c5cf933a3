"""zerotrain.train.data from samples to batches: each rank's share, epochs, resume, evaluation
batches, and two processes building through one cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from conftest import run_on_ranks
from zerotrain.train.data import EvalBatches, RankBatches, build_data, byte_tokenizer


# --- rank batches --------------------------------------------------------------------------


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i]), "labels": torch.tensor([i])}


def _ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def test_rank_batches_disjoint_equal_and_covering():
    dataset, world, micro = _Indexed(23), 3, 2
    per_rank = [[_ids(next(b)) for _ in range(len(b))]
                for b in (RankBatches(dataset, micro, rank=r, world_size=world, seed=5) for r in range(world))]
    assert {len(p) for p in per_rank} == {23 // (world * micro)}
    seen = [i for p in per_rank for batch in p for i in batch]
    assert len(seen) == len(set(seen)) == 18  # 23 minus the remainder of 5


def test_rank_batches_epochs_shuffle_differently():
    b = RankBatches(_Indexed(40), 4, seed=0)
    epoch0 = [i for _ in range(10) for i in _ids(next(b))]
    epoch1 = [i for _ in range(10) for i in _ids(next(b))]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1 and b.epoch == 1
    again = RankBatches(_Indexed(40), 4, seed=0)
    assert [i for _ in range(10) for i in _ids(next(again))] == epoch0
    other_seed = RankBatches(_Indexed(40), 4, seed=1)
    assert [i for _ in range(10) for i in _ids(next(other_seed))] != epoch0


def test_rank_batches_resume_reproduces_remaining_batches():
    dataset = _Indexed(30)
    full = RankBatches(dataset, 2, rank=1, world_size=2, seed=9)
    expected = [_ids(next(full)) for _ in range(20)]  # 7 per epoch: crosses two epoch boundaries
    for stop in (0, 3, 7, 12):
        first = RankBatches(dataset, 2, rank=1, world_size=2, seed=9)
        for _ in range(stop):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON/torch.save round trip
        resumed = RankBatches(dataset, 2, rank=1, world_size=2, seed=9)
        resumed.load_state_dict(state)
        assert [_ids(next(resumed)) for _ in range(20 - stop)] == expected[stop:]


def test_rank_batches_resume_with_other_world_size_keeps_global_order():
    dataset = _Indexed(32)
    two = [RankBatches(dataset, 2, rank=r, world_size=2, seed=0) for r in range(2)]
    for b in two:
        for _ in range(3):
            next(b)
    four = [RankBatches(dataset, 1, rank=r, world_size=4, seed=0) for r in range(4)]
    for b in four:
        b.load_state_dict(two[0].state_dict())
    assert sorted(i for b in two for i in _ids(next(b))) == sorted(i for b in four for i in _ids(next(b)))


def test_eval_batches_in_order_split_across_ranks():
    dataset = _Indexed(11)
    ranks = [EvalBatches(dataset, 2, rank=r, world_size=2) for r in range(2)]
    got = [[i for batch in r for i in _ids(batch)] for r in ranks]
    assert got == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [len(r) for r in ranks] == [3, 3]
    assert list(ranks[0]) and len(list(ranks[0])) == 3  # re-iterable
    assert len(list(EvalBatches(dataset, 2, max_batches=2))) == 2


# --- two processes -------------------------------------------------------------------------


def _two_rank_build(cache_dir: str) -> dict:
    """On each rank: build synthetic data through a shared cache; report tokenizing and batches."""
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.train.data import cache as cache_mod
    from zerotrain.train.data import corpus as corpus_mod

    launch = init_distributed()
    calls = []

    def counting(documents, tokenizer):
        calls.append(1)
        return corpus_mod.tokenize_documents(documents, tokenizer)

    cache_mod.tokenize_documents = counting
    cfg = SimpleNamespace(cache_dir=cache_dir, seq_len=16, eval_fraction=0.1,
                          synthetic=SimpleNamespace(task="copy", num_examples=200, seed=0))
    data = build_data(cfg, byte_tokenizer(), rank=launch.rank, world_size=launch.world_size)
    batches = data.train_batches(4)
    seen = []
    for _ in range(len(batches)):
        seen += batches.indices(0, batches.batch_in_epoch).tolist()
        next(batches)
    evals = [b["input_ids"].tolist() for b in data.eval_batches(4)]
    return {"tokenized": len(calls), "train": seen, "n": len(data.train), "eval": evals}


def test_two_ranks_share_cache_and_split_samples(tmp_path):
    r0, r1 = run_on_ranks(2, _two_rank_build, str(tmp_path / "cache"))
    assert (r0["tokenized"], r1["tokenized"]) == (1, 0)  # rank 0 built, rank 1 loaded after the barrier
    assert r0["n"] == r1["n"]
    assert len(r0["train"]) == len(r1["train"]) > 0
    assert not set(r0["train"]) & set(r1["train"])
    assert len(r0["eval"]) == len(r1["eval"]) > 0 and r0["eval"] != r1["eval"]
