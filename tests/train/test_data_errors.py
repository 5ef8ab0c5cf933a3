"""Bad training data fails early with a DataError naming the file, the line and the fix."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from zerotrain.train.data import (
    DataError,
    Fields,
    RankBatches,
    build_data,
    byte_tokenizer,
    read_documents,
    resolve_sources,
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def read(path, fmt="auto", **fields):
    return list(read_documents(resolve_sources(path, fmt), Fields(**fields)))


def cfg(tmp_path, **overrides):
    return SimpleNamespace(**{"cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0, "seq_len": 16, **overrides})


def expect(match_all: list[str], fn, *args, **kwargs):
    """Runs fn(*args, **kwargs); its DataError must contain every string in match_all."""
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    for part in match_all:
        assert part in str(info.value), f"{part!r} not in: {info.value}"
    return str(info.value)


def test_empty_and_blank_text_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    expect([str(tmp_path / "empty.txt"), "is empty"], read, tmp_path / "empty.txt")
    expect([str(tmp_path / "blank.txt"), "only blank lines"], read, tmp_path / "blank.txt")


def test_empty_jsonl(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    expect([str(tmp_path / "e.jsonl"), "no JSON records"], read, tmp_path / "e.jsonl")


def test_jsonl_line_that_is_not_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "unterminated\n')
    message = expect([f"{path}, line 3", "not valid JSON", "'{\"text\": \"unterminated'"], read, path)
    assert "one complete JSON object" in message


def test_long_bad_line_is_shown_as_a_snippet(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("x" * 10_000 + "\n")
    message = expect([f"{path}, line 1", "xxx..."], read, path)
    assert len(message) < 500


def test_record_missing_field_lists_its_fields(tmp_path):
    path = tmp_path / "fields.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x", "id": 2}) + "\n")
    expect([f"{path}, line 2", "'body', 'id'", "data.text_field"], read, path)


def test_record_that_is_not_an_object_or_not_a_string(tmp_path):
    path = tmp_path / "types.jsonl"
    path.write_text('["a", "list"]\n')
    expect([f"{path}, line 1", "expected a JSON object", "list"], read, path)
    path.write_text('{"text": 42}\n')
    expect([f"{path}, line 1", "'text' must be a string", "int"], read, path)


def test_text_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("fine\n\ncaf\xe9\n".encode("latin-1"))
    expect([f"{path}, line 3", "not UTF-8", "iconv"], read, path)


def test_unknown_extension_and_format(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    expect([str(path), "'.csv'", "data.format"], read, path)
    expect(["data.format 'xml'", "jsonl"], read, path, "xml")
    expect(["data.format 'arrow'", "save_to_disk"], read, path, "arrow")


def test_missing_path_and_directory_without_data(tmp_path):
    expect([str(tmp_path / "nope.jsonl"), "does not exist", "data.path"], read, tmp_path / "nope.jsonl")
    (tmp_path / "notes.csv").write_text("x\n")
    expect([str(tmp_path), "no data files", "notes.csv"], read, tmp_path)


def test_table_without_the_columns(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"body": ["a"], "id": [1]})
    table.to_parquet(str(tmp_path / "t.parquet"))
    expect([str(tmp_path / "t.parquet"), "'body', 'id'", "data.text_field"], read, tmp_path / "t.parquet")
    datasets.Dataset.from_dict({"text": ["a", None]}).to_parquet(str(tmp_path / "nulls.parquet"))
    expect([f"{tmp_path / 'nulls.parquet'}, row 2"], read, tmp_path / "nulls.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    expect([str(tmp_path / "junk.parquet"), "Parquet"], read, tmp_path / "junk.parquet")


def test_dataset_dict_without_train_split(tmp_path):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "d"))
    expect(["no 'train' split", "test"], read, tmp_path / "d")


def test_config_level_problems(tmp_path, tok):
    (tmp_path / "one.txt").write_text("a single document without blank lines\n")
    expect(["1 document", "data.eval_fraction", "data.eval_path"], build_data,
           cfg(tmp_path, path=str(tmp_path / "one.txt"), eval_fraction=0.1), tok)
    expect(["data.format is 'jsonl'", "data.path"], build_data, cfg(tmp_path, format="jsonl"), tok)
    expect(["fewer than the 4 rank(s)", "data.seq_len"], build_data,
           cfg(tmp_path, path=str(tmp_path / "one.txt"), seq_len=64), tok, world_size=4)
    expect(["data.path is", "'synthetic'"], build_data, cfg(tmp_path, path="x.txt", format="synthetic"), tok)
    expect(["pattern", "matches no files"], read, tmp_path / "*.parquet")
    expect(["data.synthetic.task 'chess'"], build_data,
           cfg(tmp_path, synthetic=SimpleNamespace(task="chess")), tok)


def test_too_few_sequences_for_ranks_and_mismatched_resume(tmp_path, tok):
    path = tmp_path / "small.txt"
    path.write_text("one\n\ntwo\n\nthree\n")
    data = build_data(cfg(tmp_path, path=str(path), seq_len=4), tok, world_size=2, rank=1)
    expect(["fewer than one micro-batch", "data.seq_len"], RankBatches, data.train, 64)
    batches = data.train_batches(1)
    state = {**batches.state_dict(), "samples": 999}
    expect(["cannot resume", "999"], batches.load_state_dict, state)
