"""The objects the offload plugins' factories return: what a ZeRO stage asks of an offload device.

A stage calls ``factory(section, context)`` with the parsed ``offload_param`` or
``offload_optimizer`` section and gets one of these. The interface:

``name``                      the device name ("none", "cpu", "nvme")
``config``                    the offload section it was built from
``zero3_partitioner(...)``    stage 3, ``offload_param``: the ``ParamPartitioner`` that keeps the
                              parameter partitions where this device says
``zero3_partitions(...)``     stage 3: the partition store (groups, optimizer, step, checkpoint access;
                              see :class:`dsplug.plugins.zero.stage3.stage.InMemoryPartitions`)
``zero12_master(...)``        stages 1/2, ``offload_optimizer``: where the fp32 master partitions live
                              and which optimizer steps them (:mod:`.zero12`)
"""
from __future__ import annotations

from dsplug.zero.partitioned_param import ParamPartitioner


class OffloadDevice:
    name = "abstract"

    def __init__(self, config, context):
        self.config = config
        self.context = context

    @property
    def accelerator(self):
        return getattr(self.context, "accelerator", None)

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

    def __repr__(self) -> str:
        return f"<offload device {self.name!r}>"


class NoOffload(OffloadDevice):
    """``device: "none"``: everything stays on the accelerator."""

    name = "none"


class CpuOffload(OffloadDevice):
    """``device: "cpu"``: host memory."""

    name = "cpu"

    def zero3_partitioner(self, comm, rank, world_size, device):
        from .params import HostParamPartitioner

        return HostParamPartitioner(comm, rank, world_size, device, accelerator=self.accelerator,
                                    pin_memory=self.config.pin_memory)


class NvmeOffload(OffloadDevice):
    """``device: "nvme"``: swap files under ``nvme_path`` (read and written through async I/O)."""

    name = "nvme"

    def zero3_partitioner(self, comm, rank, world_size, device):
        from .params import NvmeParamPartitioner

        return NvmeParamPartitioner(comm, rank, world_size, device, config=self.config, aio_config=self.aio_config(),
                                    accelerator=self.accelerator)
