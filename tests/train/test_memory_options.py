"""zerotrain train's two memory options the planner counts: selective activation checkpointing
(training.gradient_checkpointing: selective) and the chunked loss (training.loss_chunk_tokens).
Both change what is kept for backward, never what is learned: the same loss and gradients as the
model's own forward. Their bytes are checked in tests/planning/test_activation_memory.py, and at
ZeRO stage 3 on two ranks in tests/zero/test_stage3_gradient_checkpointing.py."""

from __future__ import annotations

import pytest
import torch

from train_config_fixtures import error_of, with_model, write
from zerotrain.config.errors import ConfigError
from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing
from zerotrain.runtime.chunked_loss import enable_chunked_loss
from zerotrain.train.config_files import load_train_config


def _model(arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"llama": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=300, max_position_embeddings=64),
             "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64, tie_word_embeddings=True,
                          attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)}[arch]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **sizes), attn_implementation="sdpa").train()


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch():
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt left out of the loss, as SFT data has
    labels[2, 30:] = -100
    return ids, labels


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("chunk", [7, 64, 4096], ids=["uneven-chunks", "two-chunks", "one-chunk"])
def test_the_chunked_loss_is_the_models_own_loss_and_gradients(arch, chunk):
    ids, labels = _batch()
    own_loss, own_grads = _loss_and_grads(_model(arch), ids, labels)
    chunked = _model(arch)
    enable_chunked_loss(chunked, chunk)
    loss, grads = _loss_and_grads(chunked, ids, labels)
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == own_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, own_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert chunked(input_ids=ids).logits.shape == (3, 40, 300)  # without labels: the model's own forward


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_selective_checkpointing_is_the_models_own_loss_and_gradients(arch):
    ids, labels = _batch()
    own_loss, own_grads = _loss_and_grads(_model(arch), ids, labels)
    selective = _model(arch)
    enable_gradient_checkpointing(selective, "selective")
    loss, grads = _loss_and_grads(selective, ids, labels)
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, own_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_head_the_chunked_loss_cannot_reproduce_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    # Gemma 2 soft-caps its logits after the LM head: chunking the plain head would train another loss.
    config = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=100)
    with pytest.raises(ConfigError, match="loss_chunk_tokens: not supported for model_type 'gemma2'"):
        enable_chunked_loss(AutoModelForCausalLM.from_config(config), 64)


def test_the_train_config_takes_both_options_and_refuses_a_misspelt_mode(tmp_path):
    good = write(tmp_path / "run.yaml", with_model("training:\n  gradient_checkpointing: selective\n"
                                                   "  loss_chunk_tokens: 2048\n"))
    cfg = load_train_config(good)
    assert cfg.training.gradient_checkpointing == "selective" and cfg.training.loss_chunk_tokens == 2048
    assert load_train_config(write(tmp_path / "b.yaml", with_model("training:\n  gradient_checkpointing: true\n"))
                             ).training.gradient_checkpointing is True
    bad = write(tmp_path / "c.yaml", with_model("training:\n  gradient_checkpointing: partial\n"))
    message = error_of(load_train_config, bad)
    assert "training.gradient_checkpointing" in message and "selective" in message
    zero = write(tmp_path / "d.yaml", with_model("training:\n  loss_chunk_tokens: 0\n"))
    assert "training.loss_chunk_tokens" in error_of(load_train_config, zero)


def test_zerotrain_train_refuses_a_chunked_loss_it_cannot_reproduce_before_any_rank_starts(zerotrain_main):
    # The command's own parser and checks, in this process: it ends before any rank would start.
    done = zerotrain_main("train", "--model.architecture", "gemma2", "--model.config_overrides.hidden_size", "32",
                         "--training.loss_chunk_tokens", "64", "--output.dir", "run")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "training.loss_chunk_tokens: not supported for model_type 'gemma2'" in done.stderr
    assert "zerotrain launch" not in done.stdout + done.stderr and not (zerotrain_main.cwd / "run").exists()  # no rank
