"""Where torch's fused Adam/AdamW kernel is taken, and where its scalar state then lives.

fp32 masters on the CPU or on CUDA step with torch's fused kernel: on CUDA it does in one pass
what the foreach kernel does in several (11.6 ms against 43 ms for a 1.1B model on an H100), and
it unscales and skips an fp16 step on the device (`grad_scale`, `found_inf`). It keeps each
parameter's `step` counter as an fp32 tensor on the parameter's device; the foreach and
single-tensor kernels keep it on the CPU. A checkpoint stores the counter as a number and a dtype,
nothing of a device, and `scalar_state` places it by the loading optimizer's rule, so a checkpoint
saved on a GPU loads on a CPU and back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# Device types whose fused Adam kernel zerotrain takes for fp32 masters.
FUSED_ADAM_DEVICE_TYPES = ("cpu", "cuda")


def takes_fused_adam(params: Iterable[Any]) -> bool:
    """Whether masters with these `.device` and `.dtype` step with torch's fused Adam/AdamW: all
    fp32, all on one device type with a fused kernel (the choice depends on nothing else)."""
    placements = [(torch.device(p.device).type, p.dtype) for p in params]
    return (
        bool(placements)
        and all(dtype == torch.float32 for _, dtype in placements)
        and len({kind for kind, _ in placements}) == 1
        and placements[0][0] in FUSED_ADAM_DEVICE_TYPES
    )


def scalar_state(value: float, dtype: torch.dtype, key: str, param: torch.Tensor, group: dict) -> torch.Tensor:
    """A one-element optimizer state (`value` saved as `dtype`), placed as torch's
    `Optimizer.load_state_dict` places it for the group that loads it: a fused or capturable
    group's `step` in fp32 on the parameter's device, any other `step` as saved on the CPU, and
    other floating state in the parameter's dtype on its device."""
    saved = torch.tensor(value, dtype=dtype)
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return saved.to(dtype=torch.float32, device=param.device)
        return saved
    if saved.is_floating_point() and param.is_floating_point():
        return saved.to(dtype=param.dtype, device=param.device)
    return saved.to(device=param.device)
