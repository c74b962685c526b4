"""The device abstraction every other part talks to instead of assuming CUDA.

Accelerators are plugins (category ``accelerator``). :func:`get_accelerator` picks the one named
by ``DSPLUG_ACCELERATOR`` (or ``DS_ACCELERATOR``, as DeepSpeed users set it), else the available
one with the highest ``spec.priority``.
"""
from __future__ import annotations

import abc
import os
from typing import Optional

ACCELERATOR_ENV = ("DSPLUG_ACCELERATOR", "DS_ACCELERATOR")


class Accelerator(abc.ABC):
    """Interface of an accelerator plugin. Subclasses fill in the device-specific parts."""

    name: str = "abstract"

    # -- identity
    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device type can be used in this process."""

    def device_name(self, index: Optional[int] = None) -> str:
        return self.name if index is None else f"{self.name}:{index}"

    def device(self, index: Optional[int] = None):
        import torch

        return torch.device(self.device_name(index))

    def training_device(self, local_rank: int):
        """The device a process with ``local_rank`` trains on (the engine moves the model there).
        Per-process devices by default; a device type with one shared device overrides this."""
        return self.device(local_rank)

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        pass

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """torch.distributed backend for this device (gloo, nccl, ...)."""

    # -- execution
    def synchronize(self, index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def rng_state(self):
        return None

    def set_rng_state(self, state) -> None:
        pass

    # -- memory
    def memory_allocated(self, index: Optional[int] = None) -> int:
        return 0

    def max_memory_allocated(self, index: Optional[int] = None) -> int:
        return 0

    def reset_peak_memory_stats(self, index: Optional[int] = None) -> None:
        pass

    def total_memory(self, index: Optional[int] = None) -> int:
        return 0

    def pin_memory(self, tensor):
        return tensor

    def is_pinned(self, tensor) -> bool:
        return False

    # -- capabilities
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def memory_stats(self) -> dict:
        return {
            "allocated": self.memory_allocated(),
            "max_allocated": self.max_memory_allocated(),
            "total": self.total_memory(),
        }


_CURRENT: Optional[Accelerator] = None


def get_accelerator(registry=None, refresh: bool = False) -> Accelerator:
    global _CURRENT
    if _CURRENT is not None and not refresh and registry is None:
        return _CURRENT
    from .registry import get_registry

    registry = registry or get_registry()
    wanted = next((os.environ[v] for v in ACCELERATOR_ENV if os.environ.get(v)), None)
    if wanted:
        provided = registry.get("accelerator", wanted, what=f"environment variable {ACCELERATOR_ENV[0]}")
        accel = provided.spec.factory()
        if not accel.is_available():
            raise RuntimeError(f"accelerator {wanted!r} was requested by the environment but is not available here")
    else:
        candidates = sorted(
            (p for p in registry.all() if p.category == "accelerator"),
            key=lambda p: -int(p.spec.priority),
        )
        accel = None
        for provided in candidates:
            candidate = provided.spec.factory()
            if candidate.is_available():
                accel = candidate
                break
        if accel is None:
            raise RuntimeError("no accelerator plugin is available; is the 'cpu' accelerator blocked?")
    _CURRENT = accel
    return accel


def set_accelerator(accel: Optional[Accelerator]) -> None:
    global _CURRENT
    _CURRENT = accel
