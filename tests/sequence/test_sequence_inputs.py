"""In-process checks of what sequence parallelism is given: a rank's slice of a batch, and the
inputs it refuses (with what to change) before any rank trains."""

from __future__ import annotations

import pytest
import torch

from zerotrain.config import ConfigError, load_config, resolve_config
from zerotrain.sequence import SequenceParallelError, install_ulysses_attention, shard_batch
from zerotrain.sequence.attention import check_head_split


def _batch(seq: int = 8) -> dict:
    ids = torch.arange(2 * seq).reshape(2, seq) + 100
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_labels_are_shifted_before_the_split_so_a_slice_keeps_its_last_target():
    batch = _batch()
    first, second = (shard_batch(batch, rank, 2) for rank in (0, 1))
    # Rank 0's last position predicts the first token of rank 1's slice, which rank 0 never holds.
    assert first["shift_labels"][:, -1].tolist() == batch["input_ids"][:, 4].tolist()
    assert torch.equal(torch.cat([first["shift_labels"], second["shift_labels"]], 1)[:, :-1], batch["labels"][:, 1:])
    assert second["shift_labels"][:, -1].tolist() == [-100, -100]
    assert "labels" not in first and "attention_mask" not in first


def test_a_slice_carries_global_position_ids_given_or_made():
    batch = _batch()
    assert shard_batch(batch, 1, 2)["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    packed = {**batch, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}
    assert shard_batch(packed, 1, 2)["position_ids"].tolist() == [[1, 2, 3, 4]] * 2
    assert shard_batch(batch, 1, 2)["input_ids"].tolist() == batch["input_ids"][:, 4:].tolist()


def test_sequence_length_not_divisible_is_refused_with_the_length_to_pad_to():
    with pytest.raises(SequenceParallelError, match=r"sequence length 10 is not divisible by sequence_parallel_size 4.*12"):
        shard_batch(_batch(10), 0, 4)


def test_left_padding_is_refused_and_right_padding_must_predict_nothing():
    left = _batch()
    left["attention_mask"][0, :2] = 0
    left["labels"][0, :2] = -100
    with pytest.raises(SequenceParallelError, match=r"rows \[0\] have padding before real tokens"):
        shard_batch(left, 0, 2)
    right = _batch()
    right["attention_mask"][1, 6:] = 0
    with pytest.raises(SequenceParallelError, match="set labels to -100 where attention_mask is 0"):
        shard_batch(right, 0, 2)
    right["labels"][1, 6:] = -100
    # The last real token (5) still predicts: its target is the label of token 6, already -100.
    assert shard_batch(right, 1, 2)["shift_labels"][1].tolist() == [int(right["labels"][1, 5]), -100, -100, -100]


@pytest.mark.parametrize(("heads", "kv_heads", "sp", "works"), [
    (4, 2, 3, "[1, 2, 4]"),
    (6, 3, 2, "[1, 3, 6]"),
    (4, 4, 8, "[1, 2, 4]"),
])
def test_head_counts_that_cannot_split_name_the_sizes_that_work(heads, kv_heads, sp, works):
    with pytest.raises(SequenceParallelError, match=rf"{heads} attention heads and {kv_heads} key/value.*{works}"):
        check_head_split(heads, kv_heads, sp)


def test_head_counts_that_split_pass():
    for heads, kv_heads, sp in ((4, 2, 2), (4, 2, 4), (4, 1, 4), (8, 2, 4), (8, 8, 2)):
        check_head_split(heads, kv_heads, sp)


def test_eager_attention_is_refused_with_the_reason():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager")
    with pytest.raises(SequenceParallelError, match=r"'eager' cannot run sequence-parallel: .*O\(seq\^2\).*'sdpa'"):
        install_ulysses_attention(LlamaForCausalLM(cfg), group=None)


def test_sequence_parallel_size_must_divide_the_world():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"sequence_parallel_size 3 does not divide the world size 4.*\[1, 2, 4\]"):
        resolve_config(cfg, world_size=4)


def test_batch_sizes_count_sequence_groups_not_ranks():
    cfg = resolve_config(load_config({"train_batch_size": 4, "sequence_parallel_size": 2}), world_size=4)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1)



def test_gradients_reduce_in_seq_parallel_communication_data_type_with_sequence_parallelism():
    """DeepSpeed's meaning of the key: with sp > 1 it replaces communication_data_type; fp32 when unset."""
    base = {"train_batch_size": 4, "communication_data_type": "bf16"}
    assert load_config(base).gradient_communication_dtype == torch.bfloat16
    assert load_config({**base, "sequence_parallel_size": 2}).gradient_communication_dtype == torch.float32
    chosen = {**base, "sequence_parallel_size": 2, "seq_parallel_communication_data_type": "FP16"}
    assert load_config(chosen).gradient_communication_dtype == torch.float16
