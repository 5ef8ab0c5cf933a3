"""`deepspeed.accelerator.get_accelerator()`: the device facade libraries ask for device names.

DeepSpeed picks among CUDA, XPU, NPU, HPU, ... plug-ins; zerotrain trains on CUDA with NCCL or
on CPU with Gloo, so this answers for those two.
"""

from __future__ import annotations

import os

import torch


class DeviceAccelerator:
    """The subset of DeepSpeed's accelerator interface transformers and Accelerate call."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | str | None = None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{int(device_index)}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        if not self._cuda:
            return "cpu"
        return f"cuda:{torch.cuda.current_device()}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == ("cuda" if self._cuda else "cpu")


_ACCELERATOR: DeviceAccelerator | None = None


def get_accelerator() -> DeviceAccelerator:
    """The process's device facade (one instance, as DeepSpeed keeps)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = DeviceAccelerator()
    return _ACCELERATOR
