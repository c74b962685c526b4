"""The built-in offload devices: pure storage (:class:`dsplug.contracts.OffloadDevice`).

* ``none`` — the accelerator's own memory (byte-addressable); what a stage would use if it
  asked for storage without offloading. The built-in stages do not open it: ``"none"`` means
  "keep everything where it is".
* ``cpu``  — host memory, page-locked when the section's ``pin_memory`` asks and the accelerator
  can pin (byte-addressable: the optimizer steps it in place).
* ``nvme`` — one swap file per stored tensor in a private directory under ``nvme_path``, read and
  written through the ``async_io`` native op with the ``aio`` section's settings; data moves
  only through :meth:`~NvmeOffload.read` / :meth:`~NvmeOffload.write` into the aligned,
  page-locked buffers of :meth:`~NvmeOffload.swap_buffer` (needs swap buffers).

None of them knows a ZeRO stage: what to store, when, and under which name is the stage's.
Cheap to import (torch is imported when storage is allocated).
"""
from __future__ import annotations

import os
from typing import Optional

from dsplug.contracts.offload import BYTE_ADDRESSABLE, NEEDS_SWAP_BUFFERS, DONE, OffloadDevice, Stored, Work


class NoOffload(OffloadDevice):
    """``device: "none"``: tensors in the accelerator's memory (the training device)."""

    name = "none"
    capabilities = frozenset({BYTE_ADDRESSABLE})

    def allocate(self, name: str, numel: int, dtype) -> Stored:
        import torch

        accelerator = self.accelerator
        device = accelerator.training_device(getattr(self.context, "local_rank", 0)) if accelerator is not None \
            else torch.device("cpu")
        return Stored(name, numel, dtype, tensor=torch.empty(int(numel), dtype=dtype, device=device))


class CpuOffload(OffloadDevice):
    """``device: "cpu"``: tensors in host memory (page-locked with ``pin_memory`` where possible)."""

    name = "cpu"
    capabilities = frozenset({BYTE_ADDRESSABLE})

    def allocate(self, name: str, numel: int, dtype) -> Stored:
        return Stored(name, numel, dtype, tensor=self.host_tensor(numel, dtype))


class _Writes(Work):
    def __init__(self, files, stream: int):
        self.files, self.stream = files, stream

    def wait(self) -> None:
        self.files.wait_writes(self.stream)


class _Reads(Work):
    def __init__(self, files):
        self.files = files

    def wait(self) -> None:
        self.files.wait_reads()


class NvmeOffload(OffloadDevice):
    """``device: "nvme"``: one swap file per stored tensor under ``nvme_path``.

    The first :meth:`reserve` (or :meth:`allocate`) creates this process's private directory
    ``<nvme_path>/dsplug-<section>-rank<r>-pid<pid>-*`` after checking that ``nvme_path`` is a
    writable directory with room for the bytes reserved (removing first the directories that dead
    runs of this host left behind); later reserves check the free space again. :meth:`close`
    deletes the directory. Every read checks that the file holds exactly the bytes last written
    (and their CRC-32 with ``DSPLUG_DEBUG_SWAP=1``): see :mod:`.swap`."""

    name = "nvme"
    capabilities = frozenset({NEEDS_SWAP_BUFFERS})

    def __init__(self, config, context):
        super().__init__(config, context)
        self.dir = None
        self.files = None

    @property
    def key(self) -> str:
        """The section's key (``offload_param`` / ``offload_optimizer``), naming the directory."""
        return self.config_path.rsplit(".", 1)[-1].replace(" ", "_")

    def aio_config(self):
        """The parsed ``aio`` section (its defaults when absent)."""
        config = getattr(self.context, "config", None)
        return config.section("aio") if config is not None else None

    def swap_dir(self) -> Optional[str]:
        """This process's private swap directory (None before the first reserve / allocate)."""
        return self.dir.path if self.dir is not None and not self.dir.closed else None

    # ------------------------------------------------------------------ storage
    def reserve(self, nbytes: int) -> None:
        from .swap import SwapDir, SwapError, SwapFiles, _human, available_bytes

        if self.dir is None:
            self.dir = SwapDir(self.config.nvme_path, self.key, self.rank, int(nbytes))
            self.files = SwapFiles(self.dir, self.aio_config())
            return
        free = available_bytes(self.dir.path)
        if nbytes > free:
            raise SwapError(f"{self.config_path}.nvme_path = {self.config.nvme_path!r}: {_human(nbytes)} ({nbytes} "
                            f"bytes) more of swap files are needed but only {_human(free)} ({free} bytes) are "
                            "available")

    def allocate(self, name: str, numel: int, dtype) -> Stored:
        if self.dir is None:
            self.reserve(int(numel) * dtype.itemsize)
        return Stored(name, numel, dtype, token=f"{name}.swp")

    def write(self, stored: Stored, source, stream: int = 0) -> Work:
        self._check(stored, source)
        self.files.write(source, stored.token, stream)
        return _Writes(self.files, stream)

    def read(self, stored: Stored, target) -> Work:
        self._check(stored, target)
        self.files.read(target, stored.token)
        return _Reads(self.files)

    def free(self, stored: Stored) -> None:
        if self.files is None or stored.token is None:
            return
        self.files.wait_writes()
        path = self.files.path(stored.token)
        self.files.written.pop(path, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        stored.token = None

    def location(self, stored: Stored) -> Optional[str]:
        return self.files.path(stored.token) if self.files is not None and stored.token else None

    def _check(self, stored: Stored, tensor) -> None:
        if tensor.numel() != stored.numel or tensor.dtype != stored.dtype or tensor.device.type != "cpu" \
                or not tensor.is_contiguous():
            raise ValueError(f"{self.config_path}: {stored!r} moves through a contiguous CPU tensor of {stored.numel} "
                             f"x {stored.dtype}, got {tuple(tensor.shape)} x {tensor.dtype} on {tensor.device}")

    # ------------------------------------------------------------------ buffers
    def swap_buffer(self, numel: int, dtype):
        """A 4 KiB-aligned buffer (O_DIRECT), page-locked (mlock, or through the accelerator with
        ``pin_memory``)."""
        import torch

        from dsplug.op_builder import AsyncIOBuilder

        buffer = AsyncIOBuilder().load().aio_handle().new_cpu_locked_tensor(max(1, int(numel)),
                                                                            torch.empty(0, dtype=dtype))
        return self.accelerator.pin_memory(buffer) if self.pin_memory else buffer

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        try:
            if self.files is not None:
                self.files.close()
        finally:
            if self.dir is not None:
                self.dir.close()


__all__ = ["NoOffload", "CpuOffload", "NvmeOffload", "DONE"]
