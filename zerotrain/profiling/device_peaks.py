"""Dense peak TFLOP/s of known GPUs, looked up by device name: the denominator of MFU.

Shared by the engine's flops profiler, `zerotrain train`'s metrics and the GPU benchmarks.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) peak TFLOP/s per device for (16-bit, fp32/tf32) math, from NVIDIA's datasheets;
# MFU is left blank for others. Matched in this order against the CUDA device name: the first wins.
PEAK_TFLOPS = {
    "GH200": (989.0, 494.0),
    "H200": (989.0, 494.0),
    "H100 PCIe": (756.0, 378.0),
    "H100 NVL": (835.0, 418.0),
    "H100": (989.0, 494.0),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10G": (70.0, 35.0),
    "L4": (121.0, 60.0),
    "V100": (125.0, 15.7),
}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak for the training dtype, when it is a known GPU."""
    if device.type != "cuda":
        return None
    return peak_tflops_by_name(torch.cuda.get_device_name(device), dtype)


def peak_tflops_by_name(name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The peak for a device name as CUDA reports it ("NVIDIA H100 80GB HBM3"); None if unknown."""
    for key, (half, single) in PEAK_TFLOPS.items():  # "H100 PCIe" and "H100 NVL" are listed before "H100"
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else single
    return None
