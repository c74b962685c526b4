"""The CPU accelerator: gloo collectives, host memory statistics.

Device count: the launcher's per-node process count (``LOCAL_WORLD_SIZE``, or ``LOCAL_SIZE``) when
set, else 1, as DeepSpeed's CPU accelerator reports it, so launchers and integrations that size
their world from ``device_count()`` see one "device" per local process; the current device is
``LOCAL_RANK``. Every "device" is the host (``device_name()`` is always ``"cpu"``).
"""
from __future__ import annotations

import os

from dsplug import PluginSpec
from dsplug.accelerator import Accelerator


class CpuAccelerator(Accelerator):
    name = "cpu"

    def is_available(self) -> bool:
        return True

    def device_name(self, index=None) -> str:
        return "cpu"

    def device_count(self) -> int:
        for env in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            value = os.environ.get(env, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return 1

    def current_device(self) -> int:
        value = os.environ.get("LOCAL_RANK", "0")
        return int(value) if value.isdigit() else 0

    def current_device_name(self) -> str:
        return "cpu"

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_fp16_supported(self) -> bool:
        """Whether this CPU has native fp16 kernels (oneDNN's probe: AVX512-FP16 or AMX-FP16), as
        DeepSpeed's CPU accelerator reports it. Without them torch emulates fp16 slowly, so code that
        picks a training dtype from ``supported_dtypes()`` gets fp32 / bf16. An ``fp16`` config
        section runs on any CPU either way."""
        return _onednn_has_fp16()

    def supported_dtypes(self) -> list:
        import torch

        dtypes = [torch.float32, torch.bfloat16]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def amp(self):
        import torch

        return torch.cpu.amp

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def available_memory(self, index=None) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return super().available_memory(index)

    def rng_state(self):
        return None  # the CPU generator is saved with torch's own state

    def memory_allocated(self, index=None) -> int:
        return _rss_bytes()

    def max_memory_allocated(self, index=None) -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def total_memory(self, index=None) -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def specs():
    """The CPU accelerator spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="accelerator",
            name="cpu",
            factory=CpuAccelerator,
            summary="host CPU, gloo backend",
            priority=0,
        )
    ]


def _onednn_has_fp16() -> bool:
    """oneDNN's own answer (a private torch op; a torch without it answers no)."""
    import torch

    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_fp16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except (RuntimeError, AttributeError):
        return False
