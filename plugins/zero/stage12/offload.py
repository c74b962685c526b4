"""ZeRO stages 1 and 2 with ``offload_optimizer`` (ZeRO-Offload).

Each rank's fp32 master partition (one flat tensor per param group) and the CPU optimizer's
state live in the offload device's storage, which must be byte-addressable: the CPU optimizer
(:func:`~dsplug.plugins.zero.partitioning.offload.build_host_optimizer`) steps them in place.
The reduced gradient partition is copied into a host fp32 buffer at the step (page-locked with
``pin_memory`` where an accelerator exists), unscaled and clipped there. When the model's
partition is a 16-bit host tensor, ``cpu_adam`` writes it in the same pass
(``step(fp16_param_groups=...)``); otherwise the stage copies the master into it. The updated
partitions are then all-gathered by the stage as without offloading.

As in DeepSpeed, devices that need swap buffers (``nvme``) and ``ratio`` < 1 are stage-3
features (refused by the ``zero_optimization`` rules from the stages' traits, and here again).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from dsplug.contracts.offload import BYTE_ADDRESSABLE, OffloadDevice, Stored, require

from ..partitioning.offload import PlacedState, build_host_optimizer, is_cpu_optimizer, step_writes_partitions

FP32 = torch.float32


class HostMaster:
    """What a stage-1/2 engine keeps in the ``offload_optimizer`` device (see :mod:`.stage`)."""

    def __init__(self, device: OffloadDevice, stage: int):
        config = device.config
        require(device, BYTE_ADDRESSABLE, f"ZeRO stage {stage} (its CPU optimizer steps the master partition in place; "
                                          "devices that need swap buffers are a stage-3 feature)")
        if float(getattr(config, "ratio", 1.0)) < 1.0:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {config.ratio}: a partial offload is a "
                             f"stage-3 feature (ZeRO stage {stage} steps the whole partition on the CPU); set it to 1")
        self.device = device
        self.stage = stage
        self.stored: List[Stored] = []
        self.host_grads: Dict[int, torch.Tensor] = {}
        self.optimizer = None
        self.state: Optional[PlacedState] = None
        self.written_by_step = False

    def master_of(self, gi: int, local: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s fp32 master partition in the device, initialised from ``local``."""
        stored = self.device.allocate(f"group{gi}_master", local.numel(), FP32)
        self.stored.append(stored)
        master = self.device.tensor(stored)
        with torch.no_grad():
            master.copy_(local.detach())
        return master

    def build_optimizer(self, groups: List[dict], build_optimizer):
        where = f"{self.device.config_path}.device={self.device.name!r} (ZeRO stage {self.stage})"
        self.optimizer = build_host_optimizer(groups, build_optimizer, self.device.context, where)
        if self.optimizer is not None and is_cpu_optimizer(self.optimizer):
            self.state = PlacedState(self.device, self.optimizer)
        return self.optimizer

    def host_grad(self, gi: int, part: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s reduced gradient partition as a host fp32 tensor (a buffer reused every step)."""
        buffer = self.host_grads.get(gi)
        if buffer is None or buffer.numel() != part.numel():
            buffer = self.host_grads[gi] = self.device.host_tensor(part.numel(), FP32)
        buffer.copy_(part)
        return buffer

    def step(self, optimizer, local_chunks: List[List[torch.Tensor]]) -> bool:
        """One optimizer step; True when it also wrote the model's (16-bit, host) partitions."""
        for stored in self.stored:
            self.device.prefetch(stored)
        fits = step_writes_partitions(optimizer, local_chunks)
        if fits:
            optimizer.step(fp16_param_groups=local_chunks)
        else:
            optimizer.step()
        self.written_by_step = fits
        return fits

    def state_loaded(self) -> None:
        """The optimizer's state was replaced by a checkpoint load: keep it in the device."""
        if self.state is not None:
            self.state.rehome()

    def memory_tensors(self) -> List[torch.Tensor]:
        return list(self.host_grads.values())

    def close(self) -> None:
        self.device.close()
