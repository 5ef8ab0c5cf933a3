"""Stage 3 with Hugging Face gradient checkpointing: layers recomputed in backward are gathered again;
with selective checkpointing and the chunked loss (zerotrain train's options) too."""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import train_reference, train_zerotrain, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _train_checkpointed(reuse: int, mode: bool | str = True, loss_chunk_tokens: int | None = None):
    config = zero_config(3, 2, 1, stage3_max_reuse_distance=reuse)
    run = train_zerotrain(config, checkpointing=mode, loss_chunk_tokens=loss_chunk_tokens)
    return run["losses"], run["weights"]


@pytest.mark.parametrize("reuse,mode,chunk", [(0, True, None), (10**9, True, None), (0, "selective", 24)],
                         ids=["free-after-forward", "reuse-default", "selective-chunked-loss"])
def test_stage3_with_gradient_checkpointing_matches_single_process_training(reuse, mode, chunk):
    # The chunked loss (24 tokens of the 4 x 15 a rank predicts) gathers the LM head once per chunk and again
    # in backward: the same loss and weights as the model's own loss without checkpointing.
    ref_losses, ref_weights = train_reference()
    (losses0, weights0), (losses1, _) = run_on_ranks(2, _train_checkpointed, reuse, mode, chunk)
    # each rank reports its own micro-batch loss; their mean is the global batch's loss
    mean = [(a + b) / 2 for a, b in zip(losses0, losses1)]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_weights.items():
        assert (weights0[name] - ref).norm() <= 1e-5 * ref.norm() + 1e-7, name


def _checkpoint_whole_layer_calls(reentrant: bool) -> None:
    """Checkpoints each decoder layer's whole call, module hooks included, as older transformers (5.17, on the
    GPU machine) and hand-written `checkpoint(block, x)` do: ZeRO-3's hooks then run again in backward."""
    from functools import partial

    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama import modeling_llama

    def call(layer, *args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return nn.Module.__call__(layer, *args, **kwargs)
        kwargs.pop("use_cache", None)
        for cache in ("past_key_value", "past_key_values", "cache"):
            kwargs.pop(cache, None)  # a recompute must not write the KV cache twice
        return checkpoint(partial(nn.Module.__call__, layer, **kwargs), *args, use_reentrant=reentrant)

    modeling_llama.LlamaDecoderLayer.__call__ = call  # this rank's process only


def _train_whole_call_checkpointed(reentrant: bool, reuse: int):
    _checkpoint_whole_layer_calls(reentrant)
    run = train_zerotrain(zero_config(3, 2, 1, stage3_max_reuse_distance=reuse))
    return run["losses"], run["weights"]


@pytest.mark.parametrize("reuse", [0, 10**9], ids=["free-after-forward", "reuse-default"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_stage3_matches_single_process_when_recompute_reruns_the_layer_hooks(reentrant, reuse):
    # Found on an H100 with transformers 5.17: a recompute's forward hook prefetched layers that
    # backward had already reduced, and the next step ran them with the weights of the step before.
    ref_losses, ref_weights = train_reference()
    (losses0, weights0), (losses1, _) = run_on_ranks(2, _train_whole_call_checkpointed, reentrant, reuse)
    mean = [(a + b) / 2 for a, b in zip(losses0, losses1)]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_weights.items():
        assert (weights0[name] - ref).norm() <= 1e-5 * ref.norm() + 1e-7, name
