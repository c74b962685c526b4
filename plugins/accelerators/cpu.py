"""The CPU accelerator: gloo collectives, host memory statistics."""
from __future__ import annotations

import os

from dsplug import PluginSpec, hookimpl
from dsplug.accelerator import Accelerator


class CpuAccelerator(Accelerator):
    name = "cpu"

    def is_available(self) -> bool:
        return True

    def device_name(self, index=None) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def communication_backend_name(self) -> str:
        return "gloo"

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


@hookimpl
def dsplug_accelerators():
    return [
        PluginSpec(
            category="accelerator",
            name="cpu",
            factory=CpuAccelerator,
            summary="host CPU, gloo backend",
            priority=0,
        )
    ]
