"""The built-in accelerators pass dsplug.testing.AcceleratorContract (cuda is skipped where no GPU is)."""
from __future__ import annotations

from dsplug.testing import AcceleratorContract


class TestCpuAccelerator(AcceleratorContract):
    plugin_name = "cpu"


class TestCudaAccelerator(AcceleratorContract):
    plugin_name = "cuda"


def test_cpu_accelerator_reports_fp16_as_onednn_does(monkeypatch):
    """fp32 and bf16 always; fp16 only where oneDNN has native fp16 kernels for this CPU, as
    DeepSpeed's CPU accelerator says (code choosing a training dtype from this list skips fp16 on
    CPUs that would emulate it)."""
    import torch

    from dsplug.plugins.accelerators import cpu
    from dsplug.plugins.accelerators.cpu import CpuAccelerator

    acc = CpuAccelerator()
    assert acc.is_fp16_supported() is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    monkeypatch.setattr(cpu, "_onednn_has_fp16", lambda: False)
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16]
    assert acc.is_fp16_supported() is False and acc.is_bf16_supported() is True
    monkeypatch.setattr(cpu, "_onednn_has_fp16", lambda: True)
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert acc.is_fp16_supported() is True
