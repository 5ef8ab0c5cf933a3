"""zerotrain train with training.sequence_parallel_size (Ulysses, issue 37): the key and its DeepSpeed
twin, the checks made before any rank starts, the loop's slice-and-group loss on 2 Gloo ranks (plain
and chunked loss, training and evaluation) against one process on the whole batch, and the CLI run
logging sp = 1's losses. The attention, shard and loss themselves: tests/sequence/."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from conftest import run_on_ranks
from train_config_fixtures import engine, error_of, with_model, write
from zerotrain.train.config_files import load_train_config
from zerotrain.train.memory_options import describe_memory_options
from zerotrain.train.sequence_split import check_sequence_split

SMALL = ["--model.config_overrides", '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, '
         '"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}',
         "--data.seq_len", "32"]


def test_the_key_is_read_and_the_deepspeed_sections_key_is_adopted_or_must_agree(tmp_path):
    assert load_train_config(None).training.sequence_parallel_size == 1
    assert load_train_config(None, ["--training.sequence_parallel_size", "2"]).training.sequence_parallel_size == 2
    cfg = load_train_config(write(tmp_path / "a.yaml", with_model("zero: {sequence_parallel_size: 2}\n")))
    assert cfg.training.sequence_parallel_size == 2
    assert any("taken from zero.sequence_parallel_size" in note for note in cfg.notes)
    both = write(tmp_path / "b.yaml", with_model("zero: {sequence_parallel_size: 2}\ntraining: {sequence_parallel_size: 4}\n"))
    assert "zero.sequence_parallel_size = 2 but training.sequence_parallel_size = 4" in error_of(load_train_config, both)


def test_the_engine_config_carries_the_size_and_the_batch_counts_sequence_groups():
    cfg = load_train_config(None, ["--training.sequence_parallel_size", "2", "--training.micro_batch_size", "3",
                                   "--training.gradient_accumulation_steps", "2"])
    resolved, _ = engine(cfg, world_size=4)
    assert resolved.sequence_parallel_size == 2
    assert resolved.train_batch_size == 3 * 2 * 2  # 4 ranks, 2 sequence groups: 2 samples side by side
    plain, _ = engine(load_train_config(None, ["--training.micro_batch_size", "3"]), world_size=4)
    assert plain.sequence_parallel_size == 1 and plain.train_batch_size == 12


def test_sizes_that_cannot_split_are_refused_before_launch_naming_what_works():
    cfg = load_train_config(None, ["--training.sequence_parallel_size", "3", *SMALL])
    message = error_of(check_sequence_split, cfg, 4)
    assert "training.sequence_parallel_size 3 does not divide the world size 4" in message and "[1, 2, 4]" in message
    odd = load_train_config(None, ["--training.sequence_parallel_size", "2", *SMALL, "--data.seq_len", "33"])
    assert "does not divide data.seq_len 33" in (message := error_of(check_sequence_split, odd, 2))
    assert "e.g. 34" in message
    heads = load_train_config(None, ["--training.sequence_parallel_size", "8", *SMALL])  # 4 heads, 2 KV heads
    assert "cannot split this model's attention" in (message := error_of(check_sequence_split, heads, 8))
    assert "Sizes that work for this model: [1, 2, 4]" in message
    check_sequence_split(load_train_config(None, ["--training.sequence_parallel_size", "4", *SMALL]), 4)


def test_the_command_refuses_a_size_the_processes_cannot_split_before_any_rank_starts(zerotrain_main, tmp_path):
    run = tmp_path / "run"
    result = zerotrain_main("train", "--training.sequence_parallel_size", "3", "--nproc_per_node", "2",
                            "--output.dir", run, *SMALL)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "training.sequence_parallel_size 3 does not divide the world size 2" in result.stderr
    assert not run.exists()  # nothing started


def test_memory_options_line_names_sequence_parallelism_when_on():
    zero = SimpleNamespace(stage=2, offload_optimizer=None, offload_param=None)
    assert "sequence parallel" not in describe_memory_options(False, None, zero)
    line = describe_memory_options(False, None, zero, sequence_parallel_size=4)
    assert "sequence parallel over 4 ranks, 1/4 of each sequence per rank (training.sequence_parallel_size)" in line


# --- the loop's loss on 2 ranks ----------------------------------------------------------------

VOCAB, ROWS, SEQ = 64, 3, 16


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False))


def _batch() -> dict:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt left out of the loss
    labels[1, 7:] = -100  # no target on rank 1's half of row 1
    return {"input_ids": ids, "labels": labels}


def _reference(chunk: int | None) -> dict:
    """One process, the whole batch, the model's own (or chunked) loss: loss, gradients, eval sums."""
    from zerotrain.runtime.chunked_loss import enable_chunked_loss

    model, batch = _model(), _batch()
    if chunk:
        enable_chunked_loss(model, chunk)
    loss = model(**batch).loss
    loss.backward()
    tokens = (batch["labels"][:, 1:] != -100).sum()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "eval": (loss.item() * tokens.item(), tokens.item())}


def _split_cases() -> dict:
    """On each rank: sp = 2 through the engine and SequenceSplit, plain and chunked loss (stage 3)."""
    import zerotrain
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.runtime.chunked_loss import enable_chunked_loss
    from zerotrain.sequence import uninstall_ulysses_attention
    from zerotrain.train.sequence_split import SequenceSplit
    from zerotrain.zero import GatheredParameters

    init_distributed()
    out = {}
    for chunk in (None, 7):
        model = _model()
        if chunk:
            enable_chunked_loss(model, chunk)
        split = SequenceSplit.start(2, chunked_loss=bool(chunk))
        config = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": 2, "steps_per_print": 10**9,
                  "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        eng, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
        w0 = {n: p.detach().clone() for n, p in _model().named_parameters()}
        with torch.no_grad():
            sums = split.eval_sums(eng, _batch(), torch.device("cpu"))
        loss = split.train_loss(eng, _batch(), torch.device("cpu"))
        eng.backward(loss)
        eng.step()  # SGD at lr 1: the weight change is the gradient
        with GatheredParameters(list(eng.module.parameters())):
            grads = {n: w0[n] - p.detach() for n, p in eng.module.named_parameters()}
        out[chunk] = {"loss": loss.item(), "grads": grads, "eval": sums.tolist()}
        uninstall_ulysses_attention("sdpa")
        eng.destroy()
    return out


@pytest.mark.slow
def test_the_loops_sequence_parallel_loss_and_gradient_equal_one_process_on_the_whole_batch():
    ranks = run_on_ranks(2, _split_cases)
    for chunk in (None, 7):
        want = _reference(chunk)
        eval_total = sum(torch.tensor(rank[chunk]["eval"], dtype=torch.float64) for rank in ranks)
        # fp32: the same sums in another order (the split and the all-reduce): rtol 1e-5.
        assert eval_total.tolist() == pytest.approx(list(want["eval"]), rel=1e-5)
        for rank in ranks:
            assert rank[chunk]["loss"] == pytest.approx(want["loss"], rel=1e-5)
            for name, grad in rank[chunk]["grads"].items():
                torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=1e-7, msg=f"{chunk} {name}")


# --- the command -------------------------------------------------------------------------------


def _logged(run) -> list[dict]:
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    evals = list(csv.DictReader(open(run / "eval.csv")))
    return [{k: float(r[k]) for k in ("step", "loss", "grad_norm")} for r in rows], \
        [float(r["eval_loss"]) for r in evals]


@pytest.mark.slow
def test_zerotrain_train_at_sp2_on_two_ranks_logs_sp1s_losses(zerotrain_cli, tmp_path):
    common = ["train", *SMALL, "--data.synthetic.num_examples", "400", "--data.cache_dir", tmp_path / "cache",
              "--training.micro_batch_size", "4", "--training.max_steps", "3", "--training.precision", "fp32",
              "--training.eval_interval", "3", "--training.eval_batches", "2", "--training.save_interval", "0",
              "--logging.interval", "1", "--logging.progress_bar", "false", "--output.export_hf", "false"]
    zerotrain_cli(*common, "--nproc_per_node", "1", "--output.dir", tmp_path / "sp1", check=True)
    # The same global batch (one sequence group); stage 3 and the chunked loss as well: both exact.
    sp2 = zerotrain_cli(*common, "--nproc_per_node", "2", "--output.dir", tmp_path / "sp2",
                        "--training.sequence_parallel_size", "2", "--zero.zero_optimization.stage", "3",
                        "--training.loss_chunk_tokens", "24", check=True)
    assert "2 ranks (sequence parallel 2 x data parallel 1), 128 tokens per step" in sp2.stdout + sp2.stderr
    assert "(training.sequence_parallel_size)" in sp2.stdout + sp2.stderr
    (one, one_eval), (two, two_eval) = _logged(tmp_path / "sp1"), _logged(tmp_path / "sp2")
    assert [r["step"] for r in two] == [1, 2, 3]
    # fp32, the same sums in another order over three Adam steps: rtol 1e-5. grad_norm shows a
    # gradient scale Adam would hide in the losses.
    for mine, theirs in zip(two, one):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert two_eval == pytest.approx(one_eval, rel=1e-5) and len(two_eval) == 2
    assert (tmp_path / "sp2" / "checkpoints" / "latest").exists()
