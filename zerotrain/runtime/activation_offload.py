"""Activation-checkpoint offload to CPU (`training.offload_activations`, DeepSpeed's `cpu_checkpointing`).

With each decoder layer checkpointed, what a step keeps for backward is mostly the layers' inputs:
layers x tokens x hidden size, which at long sequences outgrows the GPU. Here each checkpointed
layer's input (its hidden states) is copied to CPU memory after the layer's forward and the device
copy let go; the recompute in backward copies it back. On a GPU the copies go through pinned
memory, non-blocking, on the compute stream (so the copy back is ordered after the copy out and
before the recompute that reads it, with no host wait); on a CPU device they are plain copies.
The values are the same bits, so training is unchanged (tests/runtime/test_activation_offload.py).

How: Hugging Face layers call `layer._gradient_checkpointing_func(forward, hidden_states, ...)`
(non-reentrant `torch.utils.checkpoint`, which keeps its arguments for the recompute). The
function installed here hands the checkpoint a forward that reads the hidden states from a slot
instead: the device tensor during the forward, the CPU copy (moved back) in the recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerotrain.config.errors import ConfigError

OFFLOAD_MARK = "_zerotrain_offloads_activations"


class OffloadedInput:
    """A checkpointed layer's input: on its device for the forward, then only on the CPU until the recompute."""

    __slots__ = ("device_tensor", "cpu_tensor", "device", "requires_grad")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device_tensor: torch.Tensor | None = tensor
        self.cpu_tensor: torch.Tensor | None = None
        self.device, self.requires_grad = tensor.device, tensor.requires_grad

    def offload(self) -> None:
        """Copies the input to the CPU (pinned and non-blocking from a GPU) and drops the device tensor."""
        tensor = self.device_tensor
        pinned = tensor.device.type == "cuda"
        self.cpu_tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
        self.cpu_tensor.copy_(tensor.detach(), non_blocking=pinned)
        self.device_tensor = None

    def current(self) -> torch.Tensor:
        """The input as the layer reads it now: the device tensor, or the CPU copy brought back."""
        if self.device_tensor is not None:
            return self.device_tensor
        # requires_grad as the original: the recompute must save the same tensors the forward saved
        return self.cpu_tensor.to(self.device, non_blocking=True).requires_grad_(self.requires_grad)


def offloading_checkpoint(checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`checkpoint_fn(forward, hidden_states, *args)` with `hidden_states` kept on the CPU until the recompute."""

    def checkpoint(forward: Callable[..., Any], *args: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
            return checkpoint_fn(forward, *args)
        slot = OffloadedInput(args[0])

        def from_slot(*rest: Any) -> Any:
            return forward(slot.current(), *rest)

        output = checkpoint_fn(from_slot, *args[1:])
        slot.offload()
        return output

    return checkpoint


def enable_activation_offload(model: nn.Module, setting: str = "training.offload_activations") -> int:
    """Offloads the input of every checkpointed layer of `model` to the CPU; returns how many layers.

    Call after activation checkpointing is enabled (`enable_gradient_checkpointing`, or the HF model's
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`), whole or
    selective; ConfigError, naming `setting` (the key that asked), when no layer is checkpointed
    (nothing would be offloaded) or checkpointing is reentrant.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ConfigError(f"{setting} offloads the inputs of checkpointed layers, and no layer of "
                          f"{type(model).__name__} is checkpointed: enable gradient checkpointing first "
                          f"(training.gradient_checkpointing, or the model's gradient_checkpointing_enable()), "
                          f"or set {setting} to false")
    for layer in layers:
        if getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant", False):
            raise ConfigError(f"{setting} needs non-reentrant checkpointing: enable it with "
                              "gradient_checkpointing_kwargs={'use_reentrant': False} (zerotrain train's own is)")
        if not getattr(layer, OFFLOAD_MARK, False):
            layer._gradient_checkpointing_func = offloading_checkpoint(layer._gradient_checkpointing_func)
            setattr(layer, OFFLOAD_MARK, True)
    return len(layers)
