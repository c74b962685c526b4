"""Registers the offload devices ``none``, ``cpu`` and ``nvme`` (category ``offload_device``).

The ``nvme`` plugin owns the top-level ``aio`` section; the ``dsplug nvme-tune`` command
(:mod:`.nvme_tune`) finds good values for it. Factories are called by the ZeRO stages as
``factory(offload_section, context)`` (the parsed ``offload_param`` or ``offload_optimizer``) and
return a device object (:mod:`.devices`). Cheap to import.
"""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .config import RULES, AioConfig


def build_none(config, context):
    from .devices import NoOffload

    return NoOffload(config, context)


def build_cpu(config, context):
    from .devices import CpuOffload

    return CpuOffload(config, context)


def build_nvme(config, context):
    from .devices import NvmeOffload

    return NvmeOffload(config, context)


@hookimpl
def dsplug_offload_devices():
    return [
        PluginSpec(category="offload_device", name="none", factory=build_none,
                   summary="no offloading: partitions, master weights and optimizer states stay on the accelerator"),
        PluginSpec(category="offload_device", name="cpu", factory=build_cpu, ops=("cpu_adam",), rules=RULES,
                   summary="ZeRO-Offload: optimizer states and step (stages 1-3), parameter partitions (stage 3) "
                           "in host memory"),
        PluginSpec(category="offload_device", name="nvme", factory=build_nvme, section="aio", schema=AioConfig,
                   ops=("async_io", "cpu_adam"),
                   summary="ZeRO-Infinity: optimizer states / parameter partitions in swap files under nvme_path, "
                           "read and written through async I/O (owns the 'aio' section)"),
    ]


@hookimpl
def dsplug_cli_commands():
    from .nvme_tune import NVME_TUNE

    return [NVME_TUNE]
