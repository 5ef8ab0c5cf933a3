"""save_16bit_model: the trained weights in the training dtype, one file written by rank 0.

The format follows the file name. Anything but .bin/.pt/.pth is safetensors (the default,
model.safetensors; tied tensors stored once). DeepSpeed's own default, pytorch_model.bin,
is what transformers and DeepSpeed scripts expect to `torch.load`, so for those suffixes
the file is what DeepSpeed writes: `torch.save` of the plain state dict, tensors only
(tied tensors still share storage), which `torch.load(path, weights_only=True)` reads
without running any pickled code. Writing safetensors bytes under a .bin name would make
those loaders fail, so the name decides.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.coordination import Coordinator
from zerotrain.system.durable_files import atomic_file

log = logging.getLogger("zerotrain")

_TORCH_SAVE_SUFFIXES = (".bin", ".pt", ".pth")


def save_16bit_model(
    engine,
    save_dir: str | os.PathLike,
    save_filename: str = "model.safetensors",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Writes the module's state dict to SAVE_DIR/SAVE_FILENAME on rank 0, as DeepSpeed's.

    Every rank must call it. At stages 0-2 the parameters are whole on every rank. At
    stage 3 they are gathered only with ``stage3_gather_16bit_weights_on_model_save: true``
    (as in DeepSpeed, since that holds the whole model on every rank); without it nothing
    is written and False is returned. With `exclude_frozen_parameters` parameters with
    ``requires_grad=False`` are left out (buffers stay). Returns True on every rank once
    the file is in place.
    """
    zero = engine.parsed_config.zero_optimization
    gatherer = engine.param_gatherer
    if gatherer is not None and not zero.gather_16bit_weights_on_model_save:
        if engine.rank == 0:
            log.warning(
                "save_16bit_model: nothing saved to %s: at ZeRO stage 3 set "
                '"stage3_gather_16bit_weights_on_model_save": true in zero_optimization (as DeepSpeed '
                "requires), or save a checkpoint and run `zerotrain consolidate`",
                Path(save_dir) / save_filename,
            )
        return False
    coord = Coordinator.for_engine(engine)
    coord.meet("save_16bit_model")
    state = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
    if engine.rank == 0:
        target = Path(save_dir) / save_filename
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(target) as tmp:
            if target.suffix in _TORCH_SAVE_SUFFIXES:
                torch.save(state, tmp)
            else:
                save_file(_tied_once(state), str(tmp), metadata={"format": "pt"})
    coord.meet("save_16bit_model:done")
    return True


def consolidated_16bit_state_dict(engine, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole module's state dict in the training dtype, as CPU copies, on rank 0; None on
    the others. Every rank must call it: at stage 3 the parameters are gathered for it."""
    gatherer = engine.param_gatherer
    if gatherer is not None:
        gatherer.gather_all()  # stage 3: every rank takes part in the gathers
    try:
        return _module_state(engine.module, exclude_frozen_parameters) if engine.rank == 0 else None
    finally:
        if gatherer is not None:
            gatherer.free_all()


def _module_state(module: torch.nn.Module, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    """The state dict as compact CPU copies (parameters are views into flat buckets);
    tied tensors map to one copy."""
    frozen = set()
    if exclude_frozen_parameters:  # DeepSpeed's rule: the names named_parameters() gives
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    copies: dict[tuple, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        if name in frozen:
            continue
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True).contiguous()
        state[name] = copies[key]
    return state


def _tied_once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors stores a shared tensor once: the first name of each tied group."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out
