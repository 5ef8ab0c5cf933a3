"""The dense peak a GPU's MFU is measured against, found from the name CUDA reports."""

import pytest
import torch

from zerotrain.profiling.device_peaks import peak_tflops, peak_tflops_by_name


@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
])
def test_each_h100_variant_gets_its_own_datasheet_peak(name, bf16):
    assert peak_tflops_by_name(name) == bf16
    assert peak_tflops_by_name(name, torch.float32) < bf16


def test_an_unknown_gpu_or_the_cpu_has_no_peak():
    assert peak_tflops_by_name("Tesla T4") is None
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
