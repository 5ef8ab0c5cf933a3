"""The activation model is within 10% of the bytes autograd saves (`saved_tensors_hooks`).

Tiny Llama (grouped-query attention) and GPT-2 models are built from configs and run one
training forward; every distinct storage packed for backward is counted once, parameters
aside, and attributed to the decoder layer it was saved in (or to the rest of the model).
With gradient checkpointing each layer keeps only its input; the layer recomputed in backward
holds what a layer holds without checkpointing, which the checkpoint-free cases measure.
"""

from __future__ import annotations

import pytest
import torch

from zerotrain.planning.activation_memory import estimate_activations

BATCH, SEQ = 2, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(arch: str, attention: str):
    from transformers import AutoConfig

    if arch == "llama":
        return AutoConfig.for_model("llama", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                    max_position_embeddings=256)
    # GPT-2 with its dropouts; fused attention keeps its kernel only without attention dropout.
    return AutoConfig.for_model("gpt2", n_embd=128, n_layer=3, n_head=4, vocab_size=500, n_positions=256,
                                attn_pdrop=0.1 if attention == "eager" else 0.0)


def _measure(config, dtype: torch.dtype, attention: str, checkpointing: bool | str,
             loss_chunk_tokens: int | None = None) -> dict[str, int]:
    """Saved bytes: {"layers": in decoder layers, "rest": elsewhere}; selective checkpointing's kept
    outputs count as "layers"."""
    from transformers import AutoModelForCausalLM

    from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing, kept_by_selective_checkpointing
    from zerotrain.runtime.chunked_loss import enable_chunked_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dtype).train()
    enable_gradient_checkpointing(model, checkpointing)
    if loss_chunk_tokens:
        enable_chunked_loss(model, loss_chunk_tokens)
    layers = model.model.layers if config.model_type != "gpt2" else model.transformer.h
    depth = [0]
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
        layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in params and ptr not in seen:
            seen[ptr] = ("layers" if depth[0] else "rest", t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with kept_by_selective_checkpointing() as kept, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
        for ptr, nbytes in kept().items():
            seen.setdefault(ptr, ("layers", nbytes))
    out = {"layers": 0, "rest": 0}
    for where, nbytes in seen.values():
        out[where] += nbytes
    return out


CASES = [(arch, dtype, attention, ckpt) for arch in ("llama", "gpt2") for dtype in DTYPES
         for attention in ("eager", "sdpa") for ckpt in (False, "selective", True)]


@pytest.mark.parametrize("arch,dtype,attention,checkpointing", CASES,
                         ids=[f"{a}-{d}-{at}-{ {False: 'full', 'selective': 'selective', True: 'ckpt'}[c]}"
                              for a, d, at, c in CASES])
@pytest.mark.slow
def test_estimate_is_within_10_percent_of_what_autograd_saves(arch, dtype, attention, checkpointing):
    config = _config(arch, attention)
    measured = _measure(config, DTYPES[dtype], attention, checkpointing)
    est = estimate_activations(config, SEQ, BATCH, DTYPES[dtype], attention, device_type="cpu")
    layers = est.saved(checkpointing) - est.outside_layers_bytes - est.logits_saved_bytes
    assert layers == pytest.approx(measured["layers"], rel=0.10)
    assert est.saved(checkpointing) == pytest.approx(measured["layers"] + measured["rest"], rel=0.10)


def test_eager_attention_keeps_score_matrices_that_fused_attention_does_not():
    config = _config("llama", "eager")
    eager = estimate_activations(config, 2048, 1, torch.bfloat16, "eager")
    sdpa = estimate_activations(config, 2048, 1, torch.bfloat16, "sdpa")
    heads = config.num_attention_heads
    assert eager.per_layer_bytes - sdpa.per_layer_bytes > (4 + 2) * heads * 2048 * 2048 * 0.99


def test_the_peak_is_the_larger_of_the_logits_and_one_recomputed_layer_never_both():
    est = estimate_activations(_config("llama", "sdpa"), SEQ, BATCH, torch.bfloat16)
    mlp_gradients = 2 * 2 * BATCH * SEQ * 352  # two bf16 gradients of the MLP's width
    assert est.layer_backward(True) == est.per_layer_bytes + mlp_gradients
    assert est.total(True) == est.saved(True) - est.logits_saved_bytes + max(
        est.layer_backward(True), est.logits_peak_bytes)
    assert est.total(False) > est.total(True)
    vocab, tokens = 500, BATCH * SEQ
    assert est.logits_peak_bytes == (2 + 4 + 8) * tokens * vocab + 8 * tokens


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_chunked_loss_keeps_one_chunk_of_logits_and_is_measured_so(arch):
    config = _config(arch, "sdpa")
    measured = _measure(config, torch.float32, "sdpa", False, loss_chunk_tokens=32)
    est = estimate_activations(config, SEQ, BATCH, torch.float32, "sdpa", device_type="cpu", loss_chunk_tokens=32)
    assert est.saved(False) == pytest.approx(measured["layers"] + measured["rest"], rel=0.10)
    whole = estimate_activations(config, SEQ, BATCH, torch.float32, "sdpa", device_type="cpu")
    tokens, vocab = BATCH * SEQ, config.vocab_size
    assert whole.logits_saved_bytes - est.logits_saved_bytes == 4 * tokens * vocab  # no fp32 log-softmax kept
    assert est.logits_peak_bytes == (4 + 4 + 8) * 32 * vocab + 8 * tokens  # one chunk's logits, at most


def test_selective_checkpointing_keeps_between_none_and_whole_layers():
    est = estimate_activations(_config("llama", "sdpa"), 2048, 1, torch.bfloat16)
    assert est.saved(True) < est.saved("selective") < est.saved(False)
    # The recomputed layer at the peak: what selective did not keep, on top of what it kept.
    assert est.layer_backward("selective") == est.layer_backward(True) - est.selective_per_layer_bytes
    assert est.total("selective") == est.saved("selective") - est.logits_saved_bytes + max(
        est.layer_backward("selective"), est.logits_peak_bytes)


def test_an_unsupported_architecture_is_named():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="modelled for llama, mistral, qwen2, gpt2; this model is 'bert'"):
        estimate_activations(AutoConfig.for_model("bert"), 128, 1, torch.float32)
