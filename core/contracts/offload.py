"""The offload-device contract: a storage service for tensors kept off the accelerator.

**Who implements it**: an ``offload_device`` plugin. Its hook ``dsplug_offload_devices`` returns
``PluginSpec(category="offload_device", name=..., factory=...)``; the name is what
``zero_optimization.offload_param.device`` / ``offload_optimizer.device`` select.

**Who calls it**: a ZeRO stage, never the engine. The built-in stages (1-3) open a device for each
offload section through :func:`open_offload_device` and keep in it what they choose: fp32 master
partitions, optimizer states, parameter partitions. A device knows no stage: it stores named
flat tensors, and says through :attr:`OffloadDevice.capabilities` how they can be reached.

**Lifecycle**, in call order::

    device = factory(section, context)      # cheap: no files, no large memory yet
    device.config_path = "zero_optimization.offload_optimizer"   # set by open_offload_device
    device.reserve(nbytes)                  # optional, before allocating: refuse early if no room
    stored = device.allocate(name, numel, dtype)       # one handle per stored tensor
    device.write(stored, source).wait() / device.read(stored, target).wait()
    device.tensor(stored)                   # byte-addressable devices: the tensor itself, in place
    device.prefetch(stored)                 # a hint: it will be read soon
    device.free(stored)
    device.close()                          # engine.destroy(): release files and memory

Capabilities (:attr:`OffloadDevice.capabilities`, a frozenset of these strings):

``"byte_addressable"`` (:data:`BYTE_ADDRESSABLE`)
    :meth:`OffloadDevice.tensor` returns a tensor that *is* the stored data: the stage lets the
    optimizer read and update it in place, like host memory (``cpu``, memory-mapped files; ``none``
    keeps it in accelerator memory).
``"needs_swap_buffers"`` (:data:`NEEDS_SWAP_BUFFERS`)
    data is only reachable through :meth:`~OffloadDevice.read` / :meth:`~OffloadDevice.write`
    into host buffers, best those of :meth:`~OffloadDevice.swap_buffer` (``nvme``). The stage
    keeps a pool of such buffers and swaps data in for each use.

A stage asks for what it needs (stages 1 and 2 keep their optimizer partition in place and need
``byte_addressable``; stage 3 handles either) and refuses a device that lacks it, naming the
capability. Config checks read the capabilities from the factory when it is the device class
(``factory=MyDevice``), or from ``PluginSpec.traits`` (a frozenset of capabilities); a function
factory that declares neither is checked when the stage builds the device.

``dsplug.testing.OffloadDeviceContract`` is the suite a device runs against itself.
"""
from __future__ import annotations

from typing import Any, FrozenSet, Optional

#: :meth:`OffloadDevice.tensor` is the stored data itself, usable in place like host memory
BYTE_ADDRESSABLE = "byte_addressable"
#: data moves only through read / write into host buffers (:meth:`OffloadDevice.swap_buffer`)
NEEDS_SWAP_BUFFERS = "needs_swap_buffers"
#: every capability the kernel defines, with its meaning
CAPABILITIES = {
    BYTE_ADDRESSABLE: "tensor(stored) is the stored data, read and written in place like memory",
    NEEDS_SWAP_BUFFERS: "data moves only through read/write into host buffers (swap_buffer)",
}


class OffloadError(RuntimeError):
    """A device cannot do what it was asked: no room, an unusable path, data that does not read
    back as written. The message names the config key and the value at fault."""


class Stored:
    """The handle of one stored flat tensor: ``name`` (unique per device, usable in file names),
    ``numel``, ``dtype``; ``tensor`` is the in-place tensor of a byte-addressable device (None
    otherwise) and ``token`` whatever the device keeps to find the data (a path, a key)."""

    __slots__ = ("name", "numel", "dtype", "tensor", "token")

    def __init__(self, name: str, numel: int, dtype, tensor=None, token: Any = None):
        self.name, self.numel, self.dtype, self.tensor, self.token = name, int(numel), dtype, tensor, token

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<stored {self.name!r}: {self.numel} x {self.dtype}>"


class Work:
    """An I/O started by :meth:`OffloadDevice.read` / :meth:`~OffloadDevice.write`. ``wait()``
    returns when it is complete (and checked: a read that does not give back what was written
    raises :class:`OffloadError`); waiting twice is harmless. Waiting may also complete other work
    started earlier on the same device."""

    def wait(self) -> None:
        """Block until the I/O is complete."""


#: the work of an I/O that completed before the call returned
DONE = Work()


class OffloadDevice:
    """What an ``offload_device`` factory returns. Subclass it; ``factory(section, context)`` gets
    the parsed ``offload_param`` / ``offload_optimizer`` section (``device``, ``nvme_path``,
    ``pin_memory``, ...) and the :class:`dsplug.context.BuildContext`. A device may own more
    config (``nvme`` owns the top-level ``aio`` section) and read it from ``context.config``.

    Construction must stay cheap and free of side effects (no files, no large allocations): do
    that in :meth:`reserve` / :meth:`allocate`.

    Class attributes: ``name`` (the config value), ``capabilities`` (see the module doc).
    ``config_path``: the JSON path of the section that selected this device
    (``"zero_optimization.offload_param"``), set by :func:`open_offload_device` before any other
    call; name it in error messages.

    A byte-addressable device implements :meth:`allocate` returning ``Stored(..., tensor=t)``; the
    defaults of :meth:`tensor`, :meth:`read`, :meth:`write` and :meth:`free` then work on ``t``. A
    device that needs swap buffers implements :meth:`allocate`, :meth:`read`, :meth:`write` and
    :meth:`free` itself (and :meth:`swap_buffer` when its I/O wants special buffers).
    """

    name: str = "abstract"
    capabilities: FrozenSet[str] = frozenset()
    config_path: str = "offload device"

    def __init__(self, config: Any, context: Any):
        self.config = config
        self.context = context

    # ------------------------------------------------------------------ what the device reads
    @property
    def accelerator(self):
        return getattr(self.context, "accelerator", None)

    @property
    def rank(self) -> int:
        return int(getattr(self.context, "rank", 0) or 0)

    @property
    def pin_memory(self) -> bool:
        """The section's ``pin_memory``, where an accelerator can page-lock (not on a CPU-only run)."""
        accelerator = self.accelerator
        return bool(getattr(self.config, "pin_memory", False)) and accelerator is not None \
            and getattr(accelerator, "name", "cpu") != "cpu" and hasattr(accelerator, "pin_memory")

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    # ------------------------------------------------------------------ storage
    def reserve(self, nbytes: int) -> None:
        """The caller is about to :meth:`allocate` ``nbytes`` more bytes. A device with limited room
        raises :class:`OffloadError` now, before training starts, naming the bytes needed and
        available. Called before the first allocation and again when more is needed; optional
        for callers (the default accepts anything)."""

    def allocate(self, name: str, numel: int, dtype) -> Stored:
        """Room for a flat tensor of ``numel`` elements of ``dtype``, under ``name`` (unique on this
        device; letters, digits, ``._-``). Contents are undefined until written. Called by the
        stage while it builds its partitions and optimizer (never during a step)."""
        raise NotImplementedError(f"offload device {self.name!r} ({type(self).__name__}) does not implement "
                                  "allocate(name, numel, dtype)")

    def tensor(self, stored: Stored):
        """Byte-addressable devices: the tensor that is ``stored``'s data (1-D, ``numel`` elements;
        on the host, or the accelerator for ``none``). Reads and in-place writes of it are reads
        and writes of the stored data."""
        if stored.tensor is None:
            raise OffloadError(f"{self.config_path}: device {self.name!r} is not byte-addressable "
                               f"(capabilities: {', '.join(sorted(self.capabilities)) or 'none'}); move "
                               f"{stored.name!r} with read() / write()")
        return stored.tensor

    def write(self, stored: Stored, source, stream: int = 0) -> Work:
        """Start writing ``source`` (a contiguous CPU tensor of ``stored.numel`` elements, same
        dtype) into ``stored``. ``source`` must stay unchanged until the work is waited for.
        Writes on different ``stream`` numbers complete independently (waiting for one stream's
        work does not wait for another's); the default device completes every write at once."""
        self.tensor(stored).copy_(source.reshape(-1))
        return DONE

    def read(self, stored: Stored, target) -> Work:
        """Start reading ``stored`` into ``target`` (a contiguous CPU tensor of ``stored.numel``
        elements, same dtype); ``target`` holds the data once the work is waited for."""
        target.reshape(-1).copy_(self.tensor(stored))
        return DONE

    def prefetch(self, stored: Stored) -> None:
        """A hint: ``stored`` will be read (or, byte-addressable, touched) soon. May do nothing."""

    def free(self, stored: Stored) -> None:
        """``stored`` is not used any more; its room may be reused. The handle is dead afterwards."""
        stored.tensor = None

    def location(self, stored: Stored) -> Optional[str]:
        """Where ``stored`` lives outside the process (a file path), for tools and tests; None when
        it lives only in this process's memory."""
        return None

    # ------------------------------------------------------------------ host buffers
    def host_tensor(self, numel: int, dtype):
        """An uninitialised 1-D host tensor for data on its way between the accelerator and this
        device (gradients, staging copies): page-locked when the section's ``pin_memory`` asks for
        it and the accelerator can pin."""
        import torch

        tensor = torch.empty(int(numel), dtype=dtype, device="cpu")
        return self.accelerator.pin_memory(tensor) if self.pin_memory else tensor

    def swap_buffer(self, numel: int, dtype):
        """A host buffer that :meth:`read` / :meth:`write` move data through fastest (devices that
        need swap buffers: aligned, page-locked). Default: :meth:`host_tensor`."""
        return self.host_tensor(numel, dtype)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish pending I/O and release every file and buffer (``engine.destroy()``)."""

    def __repr__(self) -> str:
        return f"<offload device {self.name!r} ({self.config_path})>"


def capabilities_of(provided) -> Optional[FrozenSet[str]]:
    """The capabilities a registered ``offload_device`` declares without being built: its spec's
    ``traits``, else those of its factory when that is an :class:`OffloadDevice` class; None when
    neither says (a function factory: known once built)."""
    spec = provided.spec
    traits = getattr(spec, "traits", None)
    if traits is not None:
        return frozenset(traits)
    factory = spec.factory
    if isinstance(factory, type) and issubclass(factory, OffloadDevice):
        return frozenset(factory.capabilities)
    return None


def open_offload_device(section, context, config_path: str) -> Optional[OffloadDevice]:
    """Build the device ``section.device`` names (``"none"`` and absent: None), through the
    registry in ``context``, and tell it ``config_path``. What stages call; a device that is not
    an :class:`OffloadDevice` is refused with its name."""
    name = getattr(section, "device", None)
    if name in (None, "none"):
        return None
    provided = context.registry.get("offload_device", name, what=f"{config_path}.device")
    device = provided.spec.factory(section, context)
    if not isinstance(device, OffloadDevice):
        raise TypeError(f"{config_path}.device = {name!r}: the factory of offload_device plugin {provided.name!r} "
                        f"returned {type(device).__name__}, not a dsplug.contracts.OffloadDevice")
    device.config_path = config_path
    return device


def require(device: OffloadDevice, capability: str, why: str) -> None:
    """Raise a clear error when ``device`` lacks ``capability``; ``why`` says who needs it."""
    if capability not in device.capabilities:
        raise OffloadError(f"{device.config_path}.device = {device.name!r}: {why} needs a {capability!r} device, "
                           f"and {device.name!r} declares {sorted(device.capabilities) or 'no capabilities'} "
                           f"({CAPABILITIES.get(capability, capability)})")
