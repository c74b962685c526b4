"""mmap against dsplug's offload-device contract, plus what is particular to it."""
from __future__ import annotations

import os

import dsplug_mmap_offload.plugin as plugin
import torch

from dsplug.testing import OffloadDeviceContract


class TestMmapDevice(OffloadDeviceContract):
    plugin_name = "mmap"
    # registered at runtime when the distribution is not installed (a no-op when it is)
    plugins = (plugin,)
    distribution = "dsplug-mmap-offload"
    section = {"nvme_path": "{tmp_path}"}
    compare_with = "cpu"  # exactly: the same CPU optimizer steps the same values, only the memory differs

    def test_stored_tensors_are_files_under_nvme_path(self):
        device = self.build()
        stored = device.allocate("probe", 1000, torch.float32)
        device.tensor(stored).fill_(1.5)
        path = device.location(stored)
        assert path.startswith(str(self.tmp_path)) and os.path.getsize(path) == 4000
        with open(path, "rb") as f:  # the bytes are in the file: the mapping is shared
            assert torch.equal(torch.frombuffer(bytearray(f.read()), dtype=torch.float32), torch.full((1000,), 1.5))
        device.close()
        assert not os.path.exists(path)
