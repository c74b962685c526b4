"""Every built-in offload device passes dsplug.testing.OffloadDeviceContract."""
from __future__ import annotations

from dsplug.testing import OffloadDeviceContract


class TestCpuDevice(OffloadDeviceContract):
    plugin_name = "cpu"


class TestNvmeDevice(OffloadDeviceContract):
    plugin_name = "nvme"
    section = {"nvme_path": "{tmp_path}"}
    param_extra = {"max_in_cpu": 0, "buffer_count": 2, "buffer_size": 200}  # every partition swapped
    optimizer_extra = {"buffer_count": 6, "pipeline_read": True, "pipeline_write": True}
    zero_extra = {"sub_group_size": 50}  # several swapped sub-groups per step


class TestNoneDevice(OffloadDeviceContract):
    """``none`` keeps everything on the accelerator: the engine runs without offloading, whose
    optimizer (the config's AdamW) steps like the CPU Adam within float rounding."""

    plugin_name = "none"
    compare_rtol = 1e-5
    compare_atol = 1e-6
