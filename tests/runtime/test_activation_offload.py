"""Activation-checkpoint offload (runtime/activation_offload.py): bitwise the same training as checkpointing
alone (the recompute reads the same bits back), the layers' own inputs let go after the forward, and
the recompute fed from the CPU copies."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing
from zerotrain.runtime.activation_offload import enable_activation_offload


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2))


IDS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", [True, "selective"], ids=["whole-layers", "selective"])
def test_offloaded_checkpointing_trains_bitwise_as_checkpointing(mode):
    model = _tiny_llama()
    enable_gradient_checkpointing(model, mode)
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(model))
    assert enable_activation_offload(model) == 3
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref) for n, ref in ref_grads.items())


def _layer_inputs_after_forward(offload: bool) -> tuple[list, list, list]:
    """Weak references to each layer's input once the forward is done, the inputs the recompute's
    first op (input_layernorm) reads in backward, and copies of the layers' original inputs."""
    model = _tiny_llama()
    enable_gradient_checkpointing(model, True)
    if offload:
        enable_activation_offload(model)
    model.train()
    inputs, originals, recomputed = [], [], []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args, kwargs: (inputs.append(weakref.ref(args[0])),
                                                                originals.append(args[0].detach().clone())) and None,
                                        with_kwargs=True)
        layer.input_layernorm.register_forward_pre_hook(
            lambda m, args: recomputed.append(args[0]) if torch.is_grad_enabled() and _in_backward() else None)
    loss = model(input_ids=IDS, labels=IDS).loss
    alive = [ref() is not None for ref in inputs]
    loss.backward()
    return alive, recomputed, originals


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def test_offload_lets_go_of_layer_inputs_and_recomputes_from_cpu_copies():
    alive, recomputed, _ = _layer_inputs_after_forward(offload=False)
    assert alive == [True] * 3  # checkpointing alone keeps every layer's input for the recompute
    alive, recomputed, originals = _layer_inputs_after_forward(offload=True)
    assert alive == [False] * 3  # the originals are gone: each recompute (backward runs last layer first) read a copy
    assert len(recomputed) == 3
    assert all(t.device.type == "cpu" for t in recomputed)
    assert all(torch.equal(t, original) for t, original in zip(reversed(recomputed), originals))


def test_offload_without_checkpointing_says_to_turn_checkpointing_on():
    with pytest.raises(ConfigError, match="^training.offload_activations .* no layer of LlamaForCausalLM is "
                                          "checkpointed: enable gradient checkpointing first"):
        enable_activation_offload(_tiny_llama())


def _engine(model: nn.Module, **extra) -> object:
    import zerotrain

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 2}, **extra}
    return zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def test_the_deepspeed_configs_cpu_checkpointing_offloads_the_models_checkpointed_layers():
    """The DeepSpeed face: activation_checkpointing.cpu_checkpointing on a model the user (or the HF
    Trainer) checkpointed before initialize: its layers are offloaded, and a step trains bitwise alike."""
    from zerotrain.runtime.activation_offload import OFFLOAD_MARK

    losses = {}
    for offload in (False, True):
        model = _tiny_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        extra = {"activation_checkpointing": {"cpu_checkpointing": True}} if offload else {}
        engine = _engine(model, **extra)
        assert all(getattr(layer, OFFLOAD_MARK, False) is offload for layer in model.model.layers)
        engine.train()
        loss = engine(input_ids=IDS, labels=IDS).loss
        engine.backward(loss)
        engine.step()
        losses[offload] = [loss.detach(), engine(input_ids=IDS, labels=IDS).loss.detach()]
    assert all(torch.equal(a, b) for a, b in zip(losses[False], losses[True]))


def test_cpu_checkpointing_on_a_model_without_checkpointing_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpointing offloads .* no layer"):
        _engine(_tiny_llama(), activation_checkpointing={"cpu_checkpointing": True})
