"""The CUDA accelerator: NCCL collectives, device memory statistics, pinned host memory.

Written against torch's device-agnostic API so the same engine code runs on CPU and GPU.
"""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl
from dsplug.accelerator import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def current_device(self) -> int:
        import torch

        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        import torch

        torch.cuda.set_device(index)

    def device_name(self, index=None) -> str:
        return "cuda" if index is None else f"cuda:{index}"

    def communication_backend_name(self) -> str:
        return "nccl"

    def synchronize(self, index=None) -> None:
        import torch

        torch.cuda.synchronize(index)

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def rng_state(self):
        import torch

        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, state) -> None:
        import torch

        if state is not None:
            torch.cuda.set_rng_state_all(state)

    def memory_allocated(self, index=None) -> int:
        import torch

        return torch.cuda.memory_allocated(index)

    def max_memory_allocated(self, index=None) -> int:
        import torch

        return torch.cuda.max_memory_allocated(index)

    def reset_peak_memory_stats(self, index=None) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(index)

    def total_memory(self, index=None) -> int:
        import torch

        return torch.cuda.get_device_properties(index or 0).total_memory

    def pin_memory(self, tensor):
        return tensor.pin_memory()

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def is_bf16_supported(self) -> bool:
        import torch

        return torch.cuda.is_bf16_supported()


@hookimpl
def dsplug_accelerators():
    return [
        PluginSpec(
            category="accelerator",
            name="cuda",
            factory=CudaAccelerator,
            summary="NVIDIA GPUs, nccl backend",
            priority=10,
        )
    ]
