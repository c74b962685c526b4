"""ZeRO stages 1 and 2 with ``offload_optimizer.device: cpu`` (ZeRO-Offload).

Each rank's fp32 master partition (one flat tensor per param group) and the optimizer state live
in host memory (page-locked with ``pin_memory`` where an accelerator exists); the reduced
gradient partition is copied into a host fp32 buffer at the step, unscaled and clipped there, and
DeepSpeed's CPU optimizer (:mod:`.host_optimizer`) steps the partition on the CPU. When the
model's partition is a 16-bit host tensor, ``cpu_adam`` writes it in the same pass
(``step(fp16_param_groups=...)``); otherwise the stage copies the master into it. The updated
partitions are then all-gathered by the stage as without offloading.

As in DeepSpeed, ``device: nvme`` and ``ratio`` < 1 are stage-3 features (refused by config rules).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .host_optimizer import build_host_optimizer, is_cpu_optimizer
from .zero3 import HALF, HostMemory

FP32 = torch.float32


class HostMaster:
    """What a stage-1/2 engine asks of the offload device (see ``plugins/zero/partitioned.py``)."""

    def __init__(self, device, stage: int, zero_config, context):
        config = device.config
        if device.name != "cpu":
            raise ValueError(f"zero_optimization.offload_optimizer.device={device.name!r}: ZeRO stage {stage} offloads "
                             "the optimizer to 'cpu' only (swapping optimizer state to NVMe is a stage-3 feature, "
                             "as in DeepSpeed)")
        if float(config.ratio) < 1.0:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {config.ratio}: a partial offload is a "
                             f"stage-3 feature (ZeRO stage {stage} steps the whole partition on the CPU); set it to 1")
        self.stage = stage
        self.context = context
        self.memory = HostMemory(context.accelerator, config.pin_memory)
        self.host_grads: Dict[int, torch.Tensor] = {}
        self.optimizer = None
        self.written_by_step = False

    def master_of(self, local: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a partition, in host memory."""
        return self.memory(local.detach().to(device="cpu", dtype=FP32, copy=True))

    def build_optimizer(self, groups: List[dict], build_optimizer):
        where = f"zero_optimization.offload_optimizer.device='cpu' (ZeRO stage {self.stage})"
        self.optimizer = build_host_optimizer(groups, build_optimizer, self.context, where)
        return self.optimizer

    def host_grad(self, gi: int, part: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s reduced gradient partition as a host fp32 tensor (a buffer reused every step)."""
        buffer = self.host_grads.get(gi)
        if buffer is None or buffer.numel() != part.numel():
            buffer = self.host_grads[gi] = self.memory(torch.empty(part.numel(), dtype=FP32))
        buffer.copy_(part)
        return buffer

    def step(self, optimizer, local_chunks: List[List[torch.Tensor]]) -> bool:
        """One optimizer step; True when it also wrote the model's (16-bit, host) partitions."""
        fits = (is_cpu_optimizer(optimizer) and all(c.device.type == "cpu" and c.dtype in HALF
                                                     for chunks in local_chunks for c in chunks))
        if fits:
            optimizer.step(fp16_param_groups=local_chunks)
        else:
            optimizer.step()
        self.written_by_step = fits
        return fits

    def memory_tensors(self) -> List[torch.Tensor]:
        return list(self.host_grads.values())

