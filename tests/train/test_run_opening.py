"""The opening lines of a `zerotrain train` run say which memory options it trains with."""

from __future__ import annotations

import pytest

from conftest import device_env

pytestmark = pytest.mark.slow  # starts a run


def test_opening_lines_name_checkpointing_chunked_loss_and_offload(zerotrain_cli, tmp_path):
    done = zerotrain_cli(
        "train", "--nproc_per_node", "1", "--output.dir", tmp_path / "run", "--data.cache_dir", tmp_path / "cache",
        "--data.synthetic.num_examples", "200", "--training.max_steps", "1", "--training.micro_batch_size", "2",
        "--training.eval_interval", "0", "--output.export_hf", "false", "--output.save_final", "false",
        "--training.gradient_checkpointing", "selective", "--training.loss_chunk_tokens", "32",
        "--zero.zero_optimization.offload_optimizer.device", "cpu",
        env=device_env("cpu"), check=True,
    )
    lines = done.stdout.splitlines()
    memory = next((i for i, line in enumerate(lines) if line.startswith("memory options:")), None)
    assert memory is not None, done.stdout[-3000:]
    line = lines[memory]
    assert "activation checkpointing selective (training.gradient_checkpointing)" in line, line
    assert "chunked loss 32 tokens per chunk (training.loss_chunk_tokens)" in line, line
    assert "offload optimizer cpu, parameters none" in line, line
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1"))
    assert memory < first_step  # an opening line, said before any step is spent


def test_memory_options_line_says_none_and_off_for_a_plain_run():
    from types import SimpleNamespace

    from zerotrain.config.zero_schema import ZeroConfig
    from zerotrain.train.memory_options import describe_memory_options

    line = describe_memory_options(False, None, ZeroConfig(stage=2))
    assert "activation checkpointing none" in line and "chunked loss off" in line
    assert "offload optimizer none, parameters none" in line
    whole = describe_memory_options(True, None, SimpleNamespace(stage=3, offload_optimizer=None,
                                                                offload_param=SimpleNamespace(device="nvme")))
    assert "activation checkpointing full" in whole and "parameters nvme" in whole
