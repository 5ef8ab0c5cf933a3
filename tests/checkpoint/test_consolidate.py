"""Leaving zerotrain: safetensors, the in-memory state dict, Hugging Face export, peak memory, the CLI.

Checkpoints are written by checkpoint_fixtures (the format itself, over fake ranks), and at the
end by the engine's own save_checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import (
    assert_same_tensors, checkpoint_of_model, from_pretrained, load_safetensors, logits_of, peak_rss_growth,
    small_checkpoint, tiny_llama, write_checkpoint,
)
from safetensors.torch import load_file

from zerotrain.checkpoint import CheckpointError, consolidate, export_hf, load_consolidated_state_dict
from zerotrain.config.byte_sizes import parse_byte_size as parse_size
from zerotrain.checkpoint.layout import META, shard_file

REPO = Path(__file__).resolve().parents[2]


def test_single_file_equals_the_saved_tensors_exactly(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    written = consolidate(ckpt, tmp_path / "out")
    assert [p.name for p in written] == ["model.safetensors"]
    assert_same_tensors(load_file(written[0]), ref)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_state_dict_in_memory_and_a_tag_directory_given_directly(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path, tag="step7")
    assert_same_tensors(load_consolidated_state_dict(ckpt), ref)
    assert_same_tensors(load_consolidated_state_dict(ckpt / "step7"), ref)
    assert_same_tensors(load_consolidated_state_dict(ckpt, tag="step7"), ref)


def test_sharded_output_has_an_index_covering_every_tensor(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    written = consolidate(ckpt, tmp_path / "out", max_shard_size="200B")
    index_path = tmp_path / "out" / "model.safetensors.index.json"
    assert written[-1] == index_path
    shards = written[:-1]
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads(index_path.read_text())
    assert sorted(index["weight_map"]) == sorted(ref)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    for name, file in index["weight_map"].items():
        assert name in load_file(tmp_path / "out" / file)
    assert_same_tensors(load_safetensors(shards), ref)


def test_rewriting_the_output_removes_the_other_layout(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    consolidate(ckpt, tmp_path / "out", max_shard_size="200B")
    consolidate(ckpt, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    named = consolidate(ckpt, tmp_path / "named" / "weights.safetensors", max_shard_size=100)
    assert named[-1].name == "weights.safetensors.index.json" and named[0].name.startswith("weights-00001-of-")


def test_bf16_output_is_the_master_rounded_once(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    got = load_file(consolidate(ckpt, tmp_path / "out", dtype="bf16")[0])
    want = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in ref.items()}
    assert_same_tensors(got, want)
    assert got["steps"].dtype == torch.int64  # integer buffers are not cast


@pytest.mark.parametrize(
    ("text", "expected"),
    # As huggingface_hub's shard splitter (DeepSpeed's zero_to_fp32 calls it) reads max_shard_size: SI units
    # decimal, a "b" in any case bytes; binary units written out (config/byte_sizes.py, the one rule).
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("10KB", 10_000), ("2GiB", 2 * 2**30), ("8Mb", 8 * 10**6),
     (123, 123), ("77", 77)],
)
def test_sizes_are_read_as_hugging_face_reads_them(text, expected):
    assert parse_size(text) == expected


def test_bad_size_is_a_value_error():
    with pytest.raises(ValueError, match="5 parsecs"):
        parse_size("5 parsecs")


# --- bad input: every failure is a CheckpointError naming what to blame ------------------


def test_missing_shard_file_is_named(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path)
    (ckpt / "global_step1" / shard_file(1)).unlink()
    with pytest.raises(CheckpointError, match=shard_file(1)):
        consolidate(ckpt, tmp_path / "out")


def test_truncated_shard_file_is_named_and_the_old_output_survives(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    consolidate(ckpt, tmp_path / "out")
    path = ckpt / "global_step1" / shard_file(2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=shard_file(2)):
        consolidate(ckpt, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"), ref)


def test_unknown_format_names_meta_json(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path)
    meta_path = ckpt / "global_step1" / META
    meta = json.loads(meta_path.read_text())
    meta["format"] = "someone-else/9"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta\.json.*someone-else/9"):
        consolidate(ckpt, tmp_path / "out")


def test_nonexistent_tag_is_named_with_the_available_ones(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"'global_step9'.*global_step1"):
        consolidate(ckpt, tmp_path / "out", tag="global_step9")


# --- Hugging Face export ---------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_hf_directory_from_the_recorded_config_gives_the_same_logits(tmp_path, tied):
    model = tiny_llama(tied=tied)
    checkpoint_of_model(tmp_path / "ckpt", model)
    written = export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json") in written
    loaded = from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.float32
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_hf_directory_with_a_config_dir_copies_tokenizer_files_and_takes_its_dtype(tmp_path):
    model = tiny_llama()
    checkpoint_of_model(tmp_path / "ckpt", model, hf_config=None)
    source = tmp_path / "hub_model"
    model.config.dtype = torch.bfloat16
    model.config.save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        (source / name).write_text("{}")
    (source / "pytorch_model.bin").write_bytes(b"not ours to copy")
    written = export_hf(tmp_path / "ckpt", tmp_path / "hf", hf_config_dir=source)
    names = {p.name for p in written}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert "pytorch_model.bin" not in names
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    loaded = from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    for param in model.parameters():  # parameters in bf16, buffers (rotary inv_freq) as transformers keeps them
        param.data = param.data.to(torch.bfloat16)
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_hf_export_without_any_config_says_to_pass_hf(tmp_path):
    ckpt, _ = small_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="--hf MODEL_CONFIG_DIR"):
        export_hf(ckpt, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="config.json not found"):
        export_hf(ckpt, tmp_path / "hf", hf_config_dir=tmp_path)


def test_hf_export_writes_a_tied_weight_under_the_name_transformers_gives_it(tmp_path):
    model = tiny_llama(tied=True)
    alias = {"model.embed_tokens.weight": "lm_head.weight"}  # stored under its other name
    params = {alias.get(n, n): p.detach() for n, p in model.named_parameters()}
    write_checkpoint(tmp_path / "ckpt", params, hf_config=model.config.to_dict())
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    assert torch.equal(logits_of(from_pretrained(tmp_path / "hf")), logits_of(model))


def test_hf_export_lists_missing_parameter_names_before_writing(tmp_path):
    model = tiny_llama()
    params = {n: p.detach() for n, p in model.named_parameters() if "layers.1.mlp" not in n}
    write_checkpoint(tmp_path / "ckpt", params, hf_config=model.config.to_dict())
    with pytest.raises(CheckpointError, match=r"3 missing: model\.layers\.1\.mlp\.down_proj\.weight"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- memory: consolidation streams, it never holds the model ----------------------------------

@pytest.mark.slow
def test_peak_memory_stays_near_one_output_shard(tmp_path):
    params = {f"layer.{i}.weight": torch.full((512, 512), float(i)) for i in range(200)}  # 200 x 1 MiB
    model_bytes = sum(t.numel() * 4 for t in params.values())
    write_checkpoint(tmp_path / "ckpt", params, buckets=4, with_optimizer_state=False)
    streamed = peak_rss_growth("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    # The same measurement sees a whole-model load, so a small number above is not blindness.
    whole = peak_rss_growth("state_dict", str(tmp_path / "ckpt"))
    report = f"model {model_bytes / 1e6:.0f} MB: consolidate +{streamed / 1e6:.1f} MB, state dict +{whole / 1e6:.1f} MB"
    print(report)
    assert streamed < 0.4 * model_bytes, report
    assert whole > 0.8 * model_bytes, report
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) >= 10


# --- the command line -----------------------------------------------------------------------


def _zerotrain(*args) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "zerotrain", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.slow
def test_cli_writes_sharded_bf16_safetensors_and_a_summary(tmp_path):
    ckpt, ref = small_checkpoint(tmp_path)
    run = _zerotrain("consolidate", ckpt, tmp_path / "out", "--max-shard-size", "200B", "--dtype", "bf16")
    assert run.returncode == 0, run.stderr
    assert "wrote model to" in run.stdout and f"{len(ref)} tensors" in run.stdout
    got = load_safetensors(sorted((tmp_path / "out").glob("model-*.safetensors")))
    assert_same_tensors(got, {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in ref.items()})


@pytest.mark.slow
def test_cli_hf_without_a_value_uses_the_recorded_config(tmp_path):
    model = tiny_llama()
    checkpoint_of_model(tmp_path / "ckpt", model)
    run = _zerotrain("consolidate", tmp_path / "ckpt", tmp_path / "hf", "--hf")
    assert run.returncode == 0, run.stderr
    assert "Hugging Face model" in run.stdout
    assert torch.equal(logits_of(from_pretrained(tmp_path / "hf")), logits_of(model))


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--tag", "nope"], "'nope'"), (["--hf"], "--hf MODEL_CONFIG_DIR"), (["--max-shard-size", "lots"], "lots")],
)
@pytest.mark.slow
def test_cli_errors_exit_2_with_the_reason_and_no_traceback(tmp_path, args, message):
    ckpt, _ = small_checkpoint(tmp_path)
    run = _zerotrain("consolidate", ckpt, tmp_path / "out", *args)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


# --- end to end: the engine's own checkpoint ------------------------------------------------


def test_engine_checkpoint_consolidates_to_the_engines_parameters(tmp_path):
    import zerotrain

    engine, *_ = zerotrain.initialize(
        model=tiny_llama(tied=True),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 2}},
    )
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    # A tied weight is stored once, under one of its names: compare each name stored with its parameter.
    every_name = dict(engine.module.named_parameters(remove_duplicate=False))
    state = load_consolidated_state_dict(tmp_path / "ckpt")
    assert {id(every_name[n]) for n in state} == {id(p) for p in engine.module.parameters()}
    assert_same_tensors(state, {n: every_name[n].detach() for n in state})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert "model.embed_tokens.weight" in load_file(tmp_path / "hf" / "model.safetensors")  # as transformers names it
    assert torch.equal(logits_of(from_pretrained(tmp_path / "hf")), logits_of(engine.module.eval()))
