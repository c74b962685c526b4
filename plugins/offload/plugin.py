"""Registers the offload devices ``none``, ``cpu`` and ``nvme`` (category ``offload_device``;
hooks only, cheap to import).

Each is pure storage (:mod:`.devices`, :class:`dsplug.contracts.OffloadDevice`); the factories are
the device classes, so config checks read their capabilities without building one. The ``nvme``
plugin owns the top-level ``aio`` section; the ``dsplug nvme-tune`` command (:mod:`.nvme_tune`)
finds good values for it.
"""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .config import RULES, AioConfig
from .devices import CpuOffload, NoOffload, NvmeOffload


@hookimpl
def dsplug_offload_devices():
    return [
        PluginSpec(category="offload_device", name="none", factory=NoOffload,
                   summary="no offloading: partitions, master weights and optimizer states stay on the accelerator"),
        PluginSpec(category="offload_device", name="cpu", factory=CpuOffload, ops=("cpu_adam",),
                   summary="ZeRO-Offload: host memory (byte-addressable; page-locked with pin_memory)"),
        PluginSpec(category="offload_device", name="nvme", factory=NvmeOffload, section="aio", schema=AioConfig,
                   ops=("async_io", "cpu_adam"), rules=RULES,
                   summary="ZeRO-Infinity: swap files under nvme_path read and written through async I/O "
                           "(needs swap buffers; owns the 'aio' section)"),
    ]


@hookimpl
def dsplug_cli_commands():
    from .nvme_tune import NVME_TUNE

    return [NVME_TUNE]
