"""The built-in accelerators pass dsplug.testing.AcceleratorContract (cuda is skipped where no GPU is)."""
from __future__ import annotations

from dsplug.testing import AcceleratorContract


class TestCpuAccelerator(AcceleratorContract):
    plugin_name = "cpu"


class TestCudaAccelerator(AcceleratorContract):
    plugin_name = "cuda"


def test_cpu_accelerator_reports_deepspeeds_cpu_dtypes():
    """No native fp16 arithmetic on CPUs: fp32 and bf16, as DeepSpeed's CPU accelerator says (code
    choosing a training dtype from this list skips fp16 there)."""
    import torch

    from dsplug.plugins.accelerators.cpu import CpuAccelerator

    acc = CpuAccelerator()
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16]
    assert acc.is_fp16_supported() is False and acc.is_bf16_supported() is True
