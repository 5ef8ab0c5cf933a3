"""Modules of a model built under `zero.Init`, before `initialize` materializes them.

A deferred module (one that registered a parameter inside `Init`) carries the journal of its
build and its own `_apply`: `.to(device)` cannot copy its meta tensors, so the move is recorded
for `initialize` and only the dtype is applied. Modules attached to a deferred model after its
build (PEFT's LoRA layers and their adapters) are adopted: they get the same `_apply`, so a move
to their deferred base layer's device (`meta`) keeps their values instead of dropping them.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.modules import module as torch_module

DEFERRED = "_zerotrain_deferred"  # on a module built under Init: the InitJournal of its build
TARGET_DEVICE = "_zerotrain_target_device"  # where `.to(device)` asked a deferred module to go
ADOPTED = "_zerotrain_adopted"  # on a module attached to a deferred model after its build


def deferred_apply(self: nn.Module, fn, recurse: bool = True):
    """`Module._apply` for a deferred module: `.to(device)` cannot copy meta tensors, so it
    records the device (the one `initialize` moves the model to) and applies only the dtype.
    A real tensor is never moved to `meta` (PEFT moves new adapters to their deferred base
    layer's device): its values are kept for `initialize` to place (Materializer.real_values)."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            moved = fn(t)
            if moved.is_meta:
                return t.detach().to(dtype=moved.dtype)
            return moved
        try:
            return fn(t)  # dtype casts, to("meta"), to_empty
        except NotImplementedError:  # "Cannot copy out of meta tensor"
            probe = fn(torch.empty(0, dtype=t.dtype))
            object.__setattr__(self, TARGET_DEVICE, probe.device)
            return t.to(dtype=probe.dtype)

    return nn.Module._apply(self, apply, recurse)


def _adopt_into_deferred(parent: nn.Module, name: str, child):
    """Module registration hook, on from the first `Init` for the rest of the process.

    A module attached to a deferred model after its build (PEFT's LoRA layer wrapping a deferred
    base layer, the adapters it then adds) gets the deferred `_apply`, so moving it to its base
    layer's device (`meta`) keeps its values. A no-op for models that were not built under Init.
    """
    if not isinstance(child, nn.Module):
        return None
    if DEFERRED in child.__dict__ or ADOPTED in child.__dict__:
        if DEFERRED not in parent.__dict__:
            _adopt(parent)  # a wrapper around a deferred module
    elif DEFERRED in parent.__dict__ or ADOPTED in parent.__dict__:
        for m in child.modules():
            if DEFERRED not in m.__dict__:
                _adopt(m)
    return None


def _adopt(module: nn.Module) -> None:
    object.__setattr__(module, ADOPTED, True)
    object.__setattr__(module, "_apply", types.MethodType(deferred_apply, module))


_adoption_hook = None


def install_adoption_hook() -> None:
    global _adoption_hook
    if _adoption_hook is None:
        _adoption_hook = torch_module.register_module_module_registration_hook(_adopt_into_deferred)


def has_deferred_params(model: nn.Module) -> bool:
    """True when the model's parameters are still to be materialized (built under `Init`)."""
    if not any(p.is_meta for p in model.parameters()):
        return False
    if not any(DEFERRED in m.__dict__ for m in model.modules()):
        raise ValueError(
            "the model has parameters on the meta device but was not built under zerotrain.zero.Init, "
            "so nothing says how to initialize them: build it inside `with zerotrain.zero.Init():`"
        )
    return True
