"""The objects the offload plugins' factories return: :class:`dsplug.contracts.OffloadDevice`.

A stage calls ``factory(section, context)`` with the parsed ``offload_param`` or
``offload_optimizer`` section and gets one of these. Beyond the kernel's contract (``name``,
``config``, ``host_tensor``, ``swap_dir``, ``close``), the built-in ZeRO stages ask a device for
(the ZeRO <-> offload extension, documented in ``docs/offload.md``):

``zero3_partitioner(...)``    stage 3, ``offload_param``: the ``ParamPartitioner`` that keeps the
                              parameter partitions where this device says
``zero3_partitions(...)``     stage 3: the partition store (groups, optimizer, step, checkpoint access;
                              see :class:`dsplug.plugins.zero.stage3.stage.InMemoryPartitions`)
``zero12_master(...)``        stages 1/2, ``offload_optimizer``: where the fp32 master partitions live
                              and which optimizer steps them (:mod:`.zero12`)
"""
from __future__ import annotations

import os
from typing import Optional

from dsplug import contracts
from dsplug.plugins.zero.stage3.partitioned_param import ParamPartitioner


class OffloadDevice(contracts.OffloadDevice):
    """The built-in devices' base: the kernel contract plus the ZeRO stages' ``zero3_*`` / ``zero12_*``."""

    name = "abstract"

    def aio_config(self):
        """The parsed ``aio`` section (its defaults when absent)."""
        config = getattr(self.context, "config", None)
        return config.section("aio") if config is not None else None

    # ------------------------------------------------------------------ stage 3
    def zero3_partitioner(self, comm, rank: int, world_size: int, device) -> ParamPartitioner:
        return ParamPartitioner(comm, rank, world_size, device)

    def zero3_partitions(self, param_groups, model_dtype, master_weights, partitioner, zero_config, context, offload):
        from .zero3 import OffloadedPartitions

        return OffloadedPartitions(param_groups, model_dtype, master_weights, partitioner, zero_config, context,
                                   offload)

    # ------------------------------------------------------------------ stages 1 and 2
    def zero12_master(self, stage: int, zero_config, context):
        from .zero12 import HostMaster

        return HostMaster(self, stage, zero_config, context)


class NoOffload(OffloadDevice):
    """``device: "none"``: everything stays on the accelerator."""

    name = "none"


class CpuOffload(OffloadDevice):
    """``device: "cpu"``: host memory."""

    name = "cpu"

    def zero3_partitioner(self, comm, rank, world_size, device):
        from .params import HostParamPartitioner

        return HostParamPartitioner(comm, rank, world_size, device, accelerator=self.accelerator,
                                    pin_memory=self.pin_memory)


class NvmeOffload(OffloadDevice):
    """``device: "nvme"``: swap files under ``nvme_path`` (read and written through async I/O)."""

    name = "nvme"

    def swap_dir(self) -> Optional[str]:
        """``nvme_path`` (absolute): the partitioner and the partition store each create a private
        ``dsplug-<section>-rank<r>-*`` directory of swap files under it, removed at ``destroy()``."""
        path = self.config.nvme_path
        return os.path.abspath(os.path.expanduser(os.fspath(path))) if path else None

    def zero3_partitioner(self, comm, rank, world_size, device):
        from .params import NvmeParamPartitioner

        return NvmeParamPartitioner(comm, rank, world_size, device, config=self.config, aio_config=self.aio_config(),
                                    accelerator=self.accelerator)
