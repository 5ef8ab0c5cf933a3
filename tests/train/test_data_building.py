"""zerotrain.train.data from files to samples: formats, tokenizer, synthetic task, token cache, packing."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zerotrain.train.data import (
    IGNORE_INDEX,
    DataError,
    Document,
    Fields,
    PackedDataset,
    build_data,
    byte_tokenizer,
    load_tokenizer,
    read_documents,
    resolve_sources,
    synthetic_answer_accuracy,
    synthetic_examples,
    tokenize_documents,
)
from zerotrain.train.data import cache as cache_module

BOS, EOS, PAD = 256, 257, 258


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def data_cfg(tmp_path, **overrides) -> SimpleNamespace:
    """A `data` config section as the trainer passes it (attributes only)."""
    values = dict(path=None, format="auto", text_field="text", prompt_field="prompt", response_field="response",
                  seq_len=32, eval_path=None, eval_fraction=0.0, seed=0, cache_dir=str(tmp_path / "cache"),
                  synthetic=SimpleNamespace(task="arithmetic", num_examples=500, seed=0))
    values.update(overrides)
    return SimpleNamespace(**values)


def texts(path, fmt="auto", **fields) -> list[Document]:
    return list(read_documents(resolve_sources(path, fmt), Fields(**fields)))


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def trained_text(dataset: PackedDataset, tok) -> str:
    """The decoded tokens that carry loss, over the whole dataset (padding excluded)."""
    ids = []
    for i in range(len(dataset)):
        labels = dataset[i]["labels"]
        ids += [t for t in labels.tolist() if t != IGNORE_INDEX]
    return tok.decode(ids)


# --- formats -------------------------------------------------------------------------------


def test_text_file_splits_into_paragraph_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("\ufefffirst line\nstill first\n\n\n  \nsecond ünïcode\n\nthird\n")
    assert [d.text for d in texts(path)] == ["first line\nstill first", "second ünïcode", "third"]
    assert all(d.prompt == "" for d in texts(path))


def test_jsonl_text_field(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"content": "alpha", "id": 1}, {"content": "beta"}])
    path.write_text(path.read_text().replace("\n", "\n\n", 1))  # blank lines are skipped
    assert [d.text for d in texts(path, text="content")] == ["alpha", "beta"]
    data = build_data(data_cfg(tmp_path, path=str(path), text_field="content"), tok)
    assert trained_text(data.train, tok) == "alpha<|eos|>beta<|eos|>"


def test_jsonl_prompt_response_trains_only_on_response(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    write_jsonl(path, [{"prompt": "Q: 2+2?", "response": " A: 4", "text": "ignored"}, {"text": "plain"}])
    assert texts(path) == [Document(text=" A: 4", prompt="Q: 2+2?"), Document(text="plain")]
    data = build_data(data_cfg(tmp_path, path=str(path), seq_len=64), tok)
    sample = data.train[0]
    ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    prompt_len = 1 + len("Q: 2+2?")  # BOS + prompt bytes
    assert ids[:prompt_len] == [BOS] + list(b"Q: 2+2?")
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:prompt_len + 6] == list(b" A: 4") + [EOS]
    assert trained_text(data.train, tok) == " A: 4<|eos|>plain<|eos|>"


def test_json_array_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=2))
    assert [d.text for d in texts(path)] == ["one", "two"]


def test_parquet_and_save_to_disk(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": ["p1", "p2", "p3"], "n": [1, 2, 3]})
    table.to_parquet(str(tmp_path / "d.parquet"))
    assert [d.text for d in texts(tmp_path / "d.parquet")] == ["p1", "p2", "p3"]

    table.save_to_disk(str(tmp_path / "saved"))
    assert [d.text for d in texts(tmp_path / "saved")] == ["p1", "p2", "p3"]

    pairs = datasets.Dataset.from_dict({"q": ["a?", "b?"], "a": ["A", "B"]})
    datasets.DatasetDict({"train": pairs, "test": table}).save_to_disk(str(tmp_path / "dict"))
    assert texts(tmp_path / "dict", prompt="q", response="a") == [Document("A", "a?"), Document("B", "b?")]


def test_directory_reads_known_files_in_sorted_order(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "from jsonl"}\n')
    (tmp_path / "a.txt").write_text("from text\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("nested\n")
    (tmp_path / "README").write_text("not data\n")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    assert [d.text for d in texts(tmp_path)] == ["from text", "from jsonl", "nested"]
    assert [d.text for d in texts(tmp_path / "README", fmt="text")] == ["not data"]
    assert [d.text for d in texts(tmp_path / "**" / "*.[mt]*")] == ["from text", "nested"]  # a glob


# --- tokenizer -----------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_save_load(tmp_path, tok):
    from transformers import AutoTokenizer

    text = "Grüße, 世界! ✓ spaces  and\ttabs\n\nnewlines 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (BOS, EOS, PAD, 259)
    tok.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert loaded.decode(ids) == text
    assert loaded.eos_token == "<|eos|>" and len(loaded) == 259


def test_load_tokenizer_picks_spec_then_model_then_bytes(tmp_path, tok):
    assert load_tokenizer("byte", None).name_or_path == "byte"
    assert load_tokenizer(None, str(tmp_path)).name_or_path == "byte"  # no tokenizer files there
    tok.save_pretrained(tmp_path / "model")
    assert load_tokenizer(None, str(tmp_path / "model")).name_or_path == str(tmp_path / "model")
    assert load_tokenizer(str(tmp_path / "model"), None).name_or_path == str(tmp_path / "model")
    with pytest.raises(DataError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "missing"), None)


# --- synthetic -----------------------------------------------------------------------------


def test_synthetic_examples_are_deterministic_and_correct():
    first = synthetic_examples("mixed", 300, seed=3)
    assert first == synthetic_examples("mixed", 300, seed=3)
    assert first != synthetic_examples("mixed", 300, seed=4)
    assert len({e.prompt for e in first}) == 300
    for e in first:
        if "+" in e.prompt:
            a, b = e.prompt[:-1].split("+")
            assert int(e.answer) == int(a) + int(b)
        elif e.prompt.startswith("rev "):
            assert e.answer == e.prompt[4:-1][::-1]
        else:
            assert e.answer == e.prompt[5:-1]


def test_synthetic_eval_split_is_disjoint_from_training(tmp_path, tok):
    cfg = data_cfg(tmp_path, eval_fraction=0.1, seed=7)
    data = build_data(cfg, tok)
    assert len(data.eval_examples) == 50
    held_out = {e.prompt + e.answer for e in data.eval_examples}
    train_docs = set(trained_text(data.train, tok).split("<|eos|>"))
    eval_docs = set(trained_text(data.eval, tok).split("<|eos|>"))
    assert held_out == eval_docs - {""}
    assert not (train_docs - {""}) & held_out
    assert len(train_docs - {""}) == 450
    # Same seed, same split; the cache and the split do not depend on each other.
    assert build_data(cfg, tok).eval_examples == data.eval_examples


class _Oracle(torch.nn.Module):
    """A stand-in causal LM that continues synthetic prompts with the right (or a wrong) answer."""

    def __init__(self, tok, examples, wrong=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.wrong = tok, wrong
        self.answers = {e.prompt: e.answer for e in examples}

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, len(self.tok))
        for row, ids in enumerate(input_ids.tolist()):
            text = self.tok.decode(ids[1:])  # skip BOS
            prompt = text[:text.index("=") + 1]
            answer = self.answers[prompt] + ("x" if self.wrong else "")
            done = text[len(prompt):]
            nxt = answer[len(done)] if len(done) < len(answer) else None
            logits[row, -1, ord(nxt) if nxt else EOS] = 1.0
        return SimpleNamespace(logits=logits)


def test_synthetic_answer_accuracy(tok):
    examples = synthetic_examples("mixed", 40, seed=1)
    assert synthetic_answer_accuracy(_Oracle(tok, examples), tok, examples, batch_size=8) == 1.0
    assert synthetic_answer_accuracy(_Oracle(tok, examples, wrong=True), tok, examples) == 0.0


# --- cache ---------------------------------------------------------------------------------


def test_cache_skips_tokenizing_and_invalidates_on_change(tmp_path, tok, monkeypatch):
    calls = []

    def counting(documents, tokenizer):
        calls.append(1)
        return tokenize_documents(documents, tokenizer)

    monkeypatch.setattr(cache_module, "tokenize_documents", counting)
    monkeypatch.setattr("zerotrain.train.data.tokenize_progress.QUARTER_LINES_AFTER_S", 0)  # exercise progress lines
    path = tmp_path / "train.txt"
    path.write_text("one\n\ntwo\n\nthree\n")
    cfg = data_cfg(tmp_path, path=str(path), seq_len=8)
    first = build_data(cfg, tok)
    assert len(calls) == 1
    again = build_data(data_cfg(tmp_path, path=str(path), seq_len=4, eval_fraction=0.34, seed=1), tok)
    assert len(calls) == 1, "seq_len, split and seed must reuse the cached tokens"
    assert again.train.corpus.num_tokens == first.train.corpus.num_tokens
    cache_entries = [p for p in (tmp_path / "cache").iterdir()]
    assert len(cache_entries) == 1 and not cache_entries[0].name.startswith(".")
    assert sorted(p.name for p in cache_entries[0].iterdir()) == [
        "doc_masked.npy", "doc_offsets.npy", "meta.json", "tokens.npy"]

    path.write_text("one\n\ntwo\n\nfour!\n")  # new size
    assert "four!" in trained_text(build_data(cfg, tok).train, tok)
    assert len(calls) == 2
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, new mtime
    build_data(cfg, tok)
    assert len(calls) == 3
    build_data(data_cfg(tmp_path, path=str(path), seq_len=8, text_field="body"), tok)  # fields are in the key
    assert len(calls) == 4


# --- packing -------------------------------------------------------------------------------


def test_packing_fixed_length_with_padded_tail(tok):
    docs = [Document("abcde"), Document("xy", prompt="PQ"), Document("0123456789!")]
    corpus = tokenize_documents(docs, tok)
    # [BOS a b c d e EOS] [BOS P Q x y EOS] [BOS 0..9 ! EOS]: 7 + 6 + 13 = 26 tokens
    assert corpus.num_tokens == 26
    packed = PackedDataset(corpus, seq_len=8, pad_id=PAD)
    assert len(packed) == 4
    samples = [packed[i] for i in range(len(packed))]
    assert all(s["input_ids"].shape == (8,) and s["input_ids"].dtype == torch.long for s in samples)
    stream = torch.cat([s["input_ids"] for s in samples])
    assert stream[:26].tolist() == corpus.tokens.tolist()
    assert stream[26:].tolist() == [PAD] * 6
    labels = torch.cat([s["labels"] for s in samples]).tolist()
    masked = [i for i, v in enumerate(labels) if v == IGNORE_INDEX]
    # BOS of each document, the prompt "PQ", and the padding.
    assert masked == [0, 7, 8, 9, 13] + list(range(26, 32))
    # A one-token tail has no target (the model shifts labels): it is not a sample.
    assert len(PackedDataset(corpus, seq_len=5, pad_id=PAD)) == 5


def test_no_bos_when_the_tokenizer_shares_it_with_eos():
    gpt2_like = byte_tokenizer()
    gpt2_like.bos_token = "<|eos|>"  # GPT-2 style: one token begins and ends documents
    corpus = tokenize_documents([Document("ab"), Document("c", prompt="P")], gpt2_like)
    assert corpus.tokens.tolist() == [97, 98, EOS, ord("P"), 99, EOS]
    assert corpus.doc_masked.tolist() == [0, 1]


def test_packing_subset_and_prompt_only_sequences(tok):
    long_prompt = Document("ok", prompt="p" * 30)
    corpus = tokenize_documents([Document("first"), long_prompt, Document("last")], tok)
    packed = PackedDataset(corpus, seq_len=8, pad_id=PAD)
    for i in range(len(packed)):
        assert (packed[i]["labels"][1:] != IGNORE_INDEX).any()  # no sequence without a target
    assert len(packed) < -(-corpus.num_tokens // 8)  # the all-prompt ones were dropped
    subset = PackedDataset(corpus, seq_len=16, pad_id=PAD, documents=np.array([0, 2]))
    assert tok.decode(subset[0]["input_ids"][:13]) == "<|bos|>first<|eos|><|bos|>last<|eos|>"


def test_seq_len_longer_than_model_positions(tmp_path, tok):
    with pytest.raises(DataError, match=r"data.seq_len is 512 .* only 128 positions"):
        build_data(data_cfg(tmp_path, seq_len=512), tok, max_positions=128)
