"""`zerotrain train` runs what `zerotrain plan --max-seq-len` recommends: the YAML it prints for a tiny
Llama with sequence parallel 2, at a GPU memory that makes the answer a few thousand tokens, trains
for 2 steps on 2 CPU ranks, at that sequence length."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

BASE = """\
model:
  architecture: llama
  tokenizer: byte
  config_overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
                     num_key_value_heads: 2, max_position_embeddings: 65536}
data:
  format: synthetic
  seq_len: 64
  synthetic: {task: arithmetic, num_examples: 2000, seed: 0}
training:
  micro_batch_size: 1
  max_steps: 2
  sequence_parallel_size: 2
  eval_interval: 0
  save_interval: 0
  precision: fp32
zero:
  zero_optimization: {stage: 2}
logging: {interval: 1}
"""


def _merged(base: dict, keys: dict) -> dict:
    """`base` with the plan's sections laid over it, key by key (its zero section replaced whole)."""
    out = dict(base)
    for section, values in keys.items():
        out[section] = values if section == "zero" else {**base.get(section, {}), **values}
    return out


@pytest.mark.slow
def test_the_yaml_plan_recommends_for_the_longest_sequence_trains(zerotrain_main, zerotrain_cli, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(BASE)
    # 1 GiB is the reserve: a few MiB beyond it hold a tiny model's activations at a few thousand tokens.
    planned = zerotrain_main("plan", base, "--gpus", "2", "--gpu-memory", "1.005GiB", "--cpu-memory", "64GiB",
                             "--max-seq-len", "--json", check=True)
    answer = json.loads(planned.stdout)
    keys = answer["train_yaml"]
    assert keys["training"]["sequence_parallel_size"] == 2 and 1024 <= answer["max_seq_len"] <= 8192
    recommended = tmp_path / "recommended.yaml"
    recommended.write_text(yaml.safe_dump(_merged(yaml.safe_load(BASE), keys), sort_keys=False))
    run = tmp_path / "run"
    trained = zerotrain_cli("train", recommended, "--nproc_per_node", "2", "--output.dir", run, check=True,
                            timeout=600)
    assert "sequence parallel 2" in trained.stdout + trained.stderr
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["data"]["seq_len"] == answer["max_seq_len"]
    with open(run / "metrics.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [1, 2]
