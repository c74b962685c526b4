"""Registers the offload device ``mmap`` (hooks only; cheap to import: the device class imports
torch when it allocates)."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .device import MmapOffload


@hookimpl
def dsplug_offload_devices():
    return [PluginSpec(category="offload_device", name="mmap", factory=MmapOffload,
                       summary="offloaded state in memory-mapped files under nvme_path (byte-addressable, no libaio)")]
