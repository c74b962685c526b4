"""The CUDA accelerator: NCCL collectives, device memory statistics, pinned host memory.

Written against torch's device-agnostic API so the same engine code runs on CPU and GPU.
"""
from __future__ import annotations

from dsplug import PluginSpec
from dsplug.accelerator import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def is_synchronized_device(self) -> bool:
        return False

    def current_device_name(self) -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}"

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

    def manual_seed_all(self, seed: int) -> None:
        import torch

        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        import torch

        return torch.cuda.initial_seed()

    def default_generator(self, index=None):
        import torch

        return torch.cuda.default_generators[index if index is not None else torch.cuda.current_device()]

    def rng_state(self):
        import torch

        return torch.cuda.get_rng_state_all()

    def get_rng_state(self, device_index=None):
        import torch

        return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")

    def set_rng_state(self, state, device_index=None) -> None:
        """A list (what :meth:`rng_state` saved: every device) or one device's state."""
        import torch

        if state is None:
            return
        if isinstance(state, (list, tuple)):
            torch.cuda.set_rng_state_all(state)
        else:
            torch.cuda.set_rng_state(state, device_index if device_index is not None else "cuda")

    # -- streams, events, graphs
    @property
    def Stream(self):
        import torch

        return torch.cuda.Stream

    @property
    def Event(self):
        import torch

        return torch.cuda.Event

    def stream(self, stream):
        import torch

        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        import torch

        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        import torch

        return torch.cuda.default_stream(device_index)

    def create_graph(self):
        import torch

        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        import torch

        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    def lazy_call(self, callback):
        import torch

        return torch.cuda._lazy_call(callback)

    def range_push(self, msg: str) -> None:
        import torch

        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        import torch

        torch.cuda.nvtx.range_pop()

    def amp(self):
        import torch

        return torch.cuda.amp

    def is_triton_supported(self) -> bool:
        import torch

        major, _ = torch.cuda.get_device_capability()
        return major >= 7

    def export_envs(self) -> list:
        return ["NCCL"]

    # -- memory
    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def memory_reserved(self, index=None) -> int:
        import torch

        return torch.cuda.memory_reserved(index)

    def max_memory_reserved(self, index=None) -> int:
        import torch

        return torch.cuda.max_memory_reserved(index)

    def available_memory(self, index=None) -> int:
        import torch

        free, _ = torch.cuda.mem_get_info(index)
        return free

    def memory_stats(self, index=None) -> dict:
        import torch

        stats = dict(torch.cuda.memory_stats(index))
        stats.update(allocated=self.memory_allocated(index), max_allocated=self.max_memory_allocated(index),
                     total=self.total_memory(index))
        return stats

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

    def pin_memory(self, tensor, align_bytes: int = 1):
        return tensor.pin_memory()

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def is_bf16_supported(self) -> bool:
        import torch

        return torch.cuda.is_bf16_supported()


def specs():
    """The CUDA accelerator spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="accelerator",
            name="cuda",
            factory=CudaAccelerator,
            summary="NVIDIA GPUs, nccl backend",
            priority=10,
        )
    ]
