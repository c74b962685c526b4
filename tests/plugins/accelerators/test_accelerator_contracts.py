"""The built-in accelerators pass dsplug.testing.AcceleratorContract (cuda is skipped where no GPU is)."""
from __future__ import annotations

from dsplug.testing import AcceleratorContract


class TestCpuAccelerator(AcceleratorContract):
    plugin_name = "cpu"


class TestCudaAccelerator(AcceleratorContract):
    plugin_name = "cuda"
