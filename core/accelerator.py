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
    """Interface of an accelerator plugin: DeepSpeed's accelerator interface
    (``deepspeed.accelerator.get_accelerator()``), with defaults for a device that is the host
    itself. Subclasses fill in the device-specific parts; only :meth:`is_available` and
    :meth:`communication_backend_name` are required."""

    name: str = "abstract"
    #: the environment variable that selects visible devices (``CUDA_VISIBLE_DEVICES`` ...), if any
    visible_devices_env: Optional[str] = None

    # -- identity
    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device type can be used in this process."""

    @property
    def _name(self) -> str:  # DeepSpeed's attribute
        return self.name

    @property
    def _communication_backend_name(self) -> str:
        return self.communication_backend_name()

    def device_name(self, index: Optional[int] = None) -> str:
        return self.name if index is None else f"{self.name}:{index}"

    def current_device_name(self) -> str:
        """The device this process computes on, as a string (``"cuda:1"``, ``"cpu"``)."""
        return self.device_name(self.current_device())

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

    def is_synchronized_device(self) -> bool:
        """True when work runs synchronously with the host (no streams to wait for)."""
        return True

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """torch.distributed backend for this device (gloo, nccl, ...)."""

    # -- execution
    def synchronize(self, index: Optional[int] = None) -> None:
        pass

    def lazy_call(self, callback):
        return callback()

    def range_push(self, msg: str) -> None:
        """Open a named range for the device profiler (no-op where there is none)."""

    def range_pop(self) -> None:
        """Close the range of :meth:`range_push`."""

    # -- RNG
    def random(self):
        import torch

        return torch.random

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        import torch

        return torch.initial_seed()

    def default_generator(self, index: Optional[int] = None):
        import torch

        return torch.default_generator

    def rng_state(self):
        """This device type's RNG state to save with checkpoints (None: torch's CPU state covers it)."""
        return None

    def get_rng_state(self, device_index: Optional[int] = None):
        """DeepSpeed's name: the device's RNG state (torch's generator on a host device)."""
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, state, device_index: Optional[int] = None) -> None:
        """Restore an RNG state: what :meth:`rng_state` returned (checkpoints), or, as DeepSpeed
        uses it, one of :meth:`get_rng_state` (torch's generator on a host device)."""
        import torch

        if torch.is_tensor(state):
            torch.set_rng_state(state)

    # -- streams and events (none on a synchronous device)
    @property
    def Stream(self):
        return None

    @property
    def Event(self):
        return None

    def stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None):
        return None

    def default_stream(self, device_index: Optional[int] = None):
        return None

    # -- graphs (none by default)
    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        import contextlib

        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        pass

    # -- memory
    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, index: Optional[int] = None) -> int:
        return 0

    def max_memory_allocated(self, index: Optional[int] = None) -> int:
        return 0

    def reset_max_memory_allocated(self, index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(index)

    def memory_cached(self, index: Optional[int] = None) -> int:
        return self.memory_reserved(index)

    def max_memory_cached(self, index: Optional[int] = None) -> int:
        return self.max_memory_reserved(index)

    def reset_max_memory_cached(self, index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(index)

    def memory_reserved(self, index: Optional[int] = None) -> int:
        return self.memory_allocated(index)

    def max_memory_reserved(self, index: Optional[int] = None) -> int:
        return self.max_memory_allocated(index)

    def reset_peak_memory_stats(self, index: Optional[int] = None) -> None:
        pass

    def total_memory(self, index: Optional[int] = None) -> int:
        return 0

    def available_memory(self, index: Optional[int] = None) -> int:
        return max(0, self.total_memory(index) - self.memory_allocated(index))

    def memory_stats(self, index: Optional[int] = None) -> dict:
        allocated, peak = self.memory_allocated(index), self.max_memory_allocated(index)
        return {
            "allocated": allocated,
            "max_allocated": peak,
            "total": self.total_memory(index),
            "allocated_bytes.all.current": allocated,  # DeepSpeed's / torch.cuda's key names
            "allocated_bytes.all.peak": peak,
        }

    def pin_memory(self, tensor, align_bytes: int = 1):
        return tensor

    def is_pinned(self, tensor) -> bool:
        return False

    def on_accelerator(self, tensor) -> bool:
        """Whether ``tensor`` lives on this device type."""
        return tensor.device.type == self.device().type

    # -- capabilities
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        import torch

        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_triton_supported(self) -> bool:
        return False

    def amp(self):
        """The autocast module of this device type (``torch.amp`` by default)."""
        import torch

        return torch.amp

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend ``engine.compile()`` uses by default."""
        return getattr(self, "_compile_backend", "inductor")

    def set_compile_backend(self, backend: str) -> None:
        import torch

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"{backend!r} is not a torch.compile backend here (known: {', '.join(known)})")
        self._compile_backend = backend

    # -- tensor constructors on this device (DeepSpeed's ``FloatTensor(data)`` ...)
    def _tensor_of(self, dtype_name: str):
        import functools

        import torch

        return functools.partial(torch.tensor, dtype=getattr(torch, dtype_name), device=self.current_device_name())

    BFloat16Tensor = property(lambda self: self._tensor_of("bfloat16"))
    ByteTensor = property(lambda self: self._tensor_of("uint8"))
    DoubleTensor = property(lambda self: self._tensor_of("float64"))
    FloatTensor = property(lambda self: self._tensor_of("float32"))
    HalfTensor = property(lambda self: self._tensor_of("float16"))
    IntTensor = property(lambda self: self._tensor_of("int32"))
    LongTensor = property(lambda self: self._tensor_of("int64"))

    # -- native ops and launch environment
    def op_builder_dir(self) -> str:
        return "dsplug.ops.op_builder"

    def get_op_builder(self, class_name: str):
        """The op builder class named ``class_name`` (``"CPUAdamBuilder"`` ...); DeepSpeed builders
        dsplug does not have answer ``is_compatible() == False``."""
        import importlib

        return getattr(importlib.import_module("dsplug.ops.op_builder"), class_name, None)

    def create_op_builder(self, class_name: str):
        builder = self.get_op_builder(class_name)
        return builder() if builder is not None else None

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def export_envs(self) -> list:
        """Prefixes of environment variables the launcher forwards to remote nodes."""
        return []

    def visible_devices_envs(self) -> list:
        return [self.visible_devices_env] if self.visible_devices_env else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_capability(self, key: str) -> bool:
        return {"zero1": True, "zero2": True, "zero3": True}.get(key, False)


#: DeepSpeed's name for the interface
DeepSpeedAccelerator = Accelerator


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


def is_current_accelerator_supported() -> bool:
    """Whether an accelerator plugin is available for this process."""
    try:
        get_accelerator()
    except RuntimeError:
        return False
    return True
