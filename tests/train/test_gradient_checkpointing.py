"""training.gradient_checkpointing takes effect on Hugging Face models: activation memory falls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _model_section(**overrides):
    sizes = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=512)
    sizes.update(overrides)
    return SimpleNamespace(path=None, config=None, architecture="llama", config_overrides=sizes,
                           trust_remote_code=False, tokenizer=None)


class _Vocab:
    """A stand-in tokenizer: the model only asks for the vocabulary size and special ids."""

    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 512


def _peak_rss_of_one_step(checkpointing: bool) -> tuple[int, float]:
    """Runs forward+backward in a fresh process; returns (bytes saved for backward, peak RSS MiB)."""
    import resource

    from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing
    from zerotrain.train.model import build_model

    torch.manual_seed(0)
    model = build_model(_model_section(), _Vocab())
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    ids = torch.randint(0, 512, (12, 512))
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return saved[0], (peak - baseline) / 1024


@pytest.mark.timeout(300)
def test_gradient_checkpointing_lowers_activation_memory():
    (saved_plain, rss_plain), = run_on_ranks(1, _peak_rss_of_one_step, False)
    (saved_ckpt, rss_ckpt), = run_on_ranks(1, _peak_rss_of_one_step, True)
    # Tensors kept for backward outside checkpointed layers: the layers' activations are gone.
    assert saved_ckpt < 0.25 * saved_plain, (saved_ckpt, saved_plain)
    # And the process's peak memory growth over the step falls with them.
    assert rss_ckpt < rss_plain - 100, (rss_ckpt, rss_plain)
