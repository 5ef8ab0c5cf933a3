"""save_16bit_model: the trained weights in the training dtype, one safetensors file from rank 0."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.coordination import Coordinator


def save_16bit_model(engine, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> bool:
    """Writes the module's state dict (tied tensors once) to SAVE_DIR/SAVE_FILENAME on rank 0.

    Every rank must call it. At stages 0-2 the parameters are whole on every rank;
    stage 3 gathers them first. Returns True on the rank that wrote.
    """
    coord = Coordinator.for_engine(engine)
    coord.meet("save_16bit_model")
    gatherer = engine.param_gatherer
    if gatherer is not None:
        gatherer.gather_all()  # stage 3: every rank takes part in the gathers
    wrote = False
    if engine.rank == 0:
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in engine.module.state_dict().items():
            key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            if (key, tuple(t.shape)) in seen:  # tied weights: safetensors stores shared tensors once
                continue
            seen.add((key, tuple(t.shape)))
            tensors[name] = t.detach().cpu().contiguous()
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{save_filename}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / save_filename)
        wrote = True
    if gatherer is not None:
        gatherer.free_all()
    coord.meet("save_16bit_model:done")
    return wrote
