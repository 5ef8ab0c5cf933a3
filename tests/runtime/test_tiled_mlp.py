"""Tiled MLP (runtime/tiled_mlp.py): the same loss and gradients as the untiled MLP, each parameter's
gradient accumulated once, dropout masks reproduced in the recompute, and ZeRO-3 on 2 ranks with a
different sequence length (so a different tile count) per rank equal to one process on both batches.

Equality: the loss and every gradient outside the MLP weights are bitwise equal (each token's MLP
output and input gradient are the same per-token computation). An MLP weight's gradient is the sum of
the tiles' partial matmuls instead of one matmul over all tokens: equal up to fp32 summation order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import run_on_ranks
from llama_workload import CLIP, LR, SEQ, global_batch, make_model, param_groups, zero_config
from zerotrain.config.errors import ConfigError
from zerotrain.runtime.tiled_mlp import enable_tiled_mlp, tile_count

TOKENS = 40  # per sequence; with 16-token tiles: 3 tiles, the last one short


def _tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    from transformers import Qwen2Config, Qwen2ForCausalLM  # Qwen2/Mistral-style: biased attention, same MLP shape

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1))


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(kind):
    model = _tiny(kind)
    ids = torch.randint(0, 64, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(model), ids)
    assert enable_tiled_mlp(model, tile_tokens=16) == 2
    loss, grads = _loss_and_grads(model, ids)
    assert torch.equal(loss, ref_loss)
    for name, ref in ref_grads.items():
        if ".mlp." in name:  # tile sums: fp32 summation order
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert torch.equal(grads[name], ref), name


def test_tiled_mlp_runs_each_tile_once_in_forward_and_once_in_backward():
    # Without this the equality above would also hold for an MLP that was never tiled.
    model = _tiny("llama")
    enable_tiled_mlp(model, tile_tokens=16)
    rows = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    ids = torch.randint(0, 64, (1, TOKENS))
    _loss_and_grads(model, ids)
    assert rows == [16, 16, 8] * 2


def test_tiled_mlp_accumulates_each_parameter_gradient_once():
    # zerotrain's reducer launches a parameter's reduction from its post-accumulate hook: one call per backward.
    model = _tiny("llama")
    enable_tiled_mlp(model, tile_tokens=8)
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    _loss_and_grads(model, torch.randint(0, 64, (2, TOKENS)))
    assert calls == {name: 1 for name, _ in model.named_parameters()}


def test_tile_count_is_deepspeeds_rule_or_the_tile_size():
    assert tile_count(100, 32, None) == 4  # DeepSpeed: ceil(sequence length / hidden size)
    assert tile_count(100, 32, 16) == 7
    assert tile_count(5, 32, None) == 1


def test_tiled_mlp_recompute_uses_the_forward_dropout_masks():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    layer = nn.Module()
    layer.mlp = GPT2MLP(64, GPT2Config(n_embd=32, resid_pdrop=0.5))
    reference = copy.deepcopy(layer.mlp)
    enable_tiled_mlp(layer, tile_tokens=10)
    x = torch.randn(1, 30, 32, requires_grad=True)
    weight = torch.randn(1, 30, 32)
    torch.manual_seed(7)
    (layer.mlp(x) * weight).sum().backward()
    # The reference draws the same masks: the same tiles in the same order from the same seed.
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    out = torch.cat([reference(tile) for tile in x_ref.reshape(30, 32).split(10)]).view(1, 30, 32)
    (out * weight).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    for (name, p), ref in zip(layer.mlp.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_tiled_mlp_refuses_a_mixture_of_experts_mlp():
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    with pytest.raises(ConfigError, match="mixture of experts.*training.tiled_mlp: false"):
        enable_tiled_mlp(layer)


def test_tiled_mlp_refuses_a_model_without_an_mlp():
    with pytest.raises(ConfigError, match="no decoder layer with an `mlp`"):
        enable_tiled_mlp(nn.Sequential(nn.Linear(4, 4)))


STEPS = 3
SHORTER = 4  # rank 1's sequences are this much shorter: 16 vs 12 tiles of 4 tokens


def _rank_batch(step: int, rank: int) -> torch.Tensor:
    return global_batch(step)[rank * 4 : rank * 4 + 4, : SEQ - SHORTER * rank]


def _reference() -> dict[str, torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for step in range(STEPS):
        # Each rank's loss is the mean over its tokens; the engine averages the ranks' gradients.
        loss = sum(model(input_ids=b, labels=b).loss for b in (_rank_batch(step, 0), _rank_batch(step, 1))) / 2
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero3_tiled_runs() -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing
    from zerotrain.runtime.activation_offload import enable_activation_offload
    from zerotrain.zero import GatheredParameters

    out = {}
    for case in ("tiled", "tiled-checkpointed-offloaded"):
        model = make_model()
        enable_tiled_mlp(model, tile_tokens=4)
        if case != "tiled":
            enable_gradient_checkpointing(model, True)
            enable_activation_offload(model)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 2, 1))
        for step in range(STEPS):
            loss = engine(input_ids=_rank_batch(step, dist.get_rank()), labels=_rank_batch(step, dist.get_rank())).loss
            engine.backward(loss)
            engine.step()
        with GatheredParameters(list(engine.module.parameters())):
            out[case] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


@pytest.mark.slow
def test_zero3_tiled_mlp_with_a_different_sequence_length_per_rank_matches_one_process():
    # fp32, AdamW for 3 steps: tolerance as tests/zero/test_parity.py (summation order of the reduction and tiles).
    runs, _ = run_on_ranks(2, _zero3_tiled_runs)
    reference = _reference()
    for case, weights in runs.items():
        for name, ref in reference.items():
            assert (weights[name] - ref).norm() <= 1e-5 * ref.norm() + 1e-7, (case, name)
