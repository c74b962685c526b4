"""Stage 3 parameter partitions in an offload device (``offload_param``), through the storage
contract (:class:`dsplug.contracts.OffloadDevice`).

* :class:`StoredParamPartitioner` (a byte-addressable device: ``cpu``, ``mmap``, ...): each
  optimizer param group's partitions live in one stored flat tensor of the device
  (:meth:`~StoredParamPartitioner.allocate_flat`), used in place; :meth:`local_piece` copies a
  partition to the accelerator just before it is all-gathered. Partitions outside the optimizer
  (frozen parameters) stay in host memory (page-locked with ``pin_memory`` where possible).
* :class:`SwappedParamPartitioner` (a device that needs swap buffers: ``nvme``): the first
  parameters, up to ``max_in_cpu`` partition elements in all, stay in host memory; every other
  partition is stored in the device on its own and ``p.ds_tensor`` is a placeholder without
  memory (:func:`placeholder`). A gather reads the partitions into ``buffer_count`` swap buffers
  of ``buffer_size`` elements (several small partitions share a buffer); the reads are waited for,
  and the all-gather sent from the buffer, when the gather is waited for (so the reads of prefetched
  parameters overlap compute), and the buffer goes back then; with every buffer in use, the oldest
  gather is completed first. Writes (the updated partitions after a step, ``GatheredParameters``
  with a modifier rank, module loads) go through :meth:`store_piece` / :meth:`store_pieces`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from dsplug.contracts.offload import BYTE_ADDRESSABLE, OffloadDevice, OffloadError, Stored

from ..partitioning.offload import SwapBufferPool
from .partitioned_param import GatherHandle, ParamPartitioner, ZeroParamStatus


def placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for a partition stored off the process: right numel and dtype, no memory.
    Reading it (``.to()``, ``.cpu()``, arithmetic with real tensors) raises; writes go through
    :meth:`SwappedParamPartitioner.store_pieces`."""
    return torch.empty(numel, dtype=dtype, device="meta")


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


def param_partitioner(device: OffloadDevice, comm, rank: int, world_size: int, compute_device, section):
    """The partitioner for ``offload_param``'s device: in place when byte-addressable, else swapped."""
    if BYTE_ADDRESSABLE in device.capabilities:
        return StoredParamPartitioner(comm, rank, world_size, compute_device, device=device)
    return SwappedParamPartitioner(comm, rank, world_size, compute_device, device=device, config=section)


class StoredParamPartitioner(ParamPartitioner):
    """Partitions in host memory or a byte-addressable device's storage."""

    def __init__(self, comm, rank, world_size, compute_device, *, device: OffloadDevice):
        super().__init__(comm, rank, world_size, compute_device, partition_device="cpu")
        self.offload_device = device
        self.stored: List[Stored] = []

    @property
    def pin(self) -> bool:
        return self.offload_device.pin_memory

    def adopt(self, p, dtype=None) -> None:
        super().adopt(p, dtype=dtype)
        accelerator = self.offload_device.accelerator
        if self.pin and not accelerator.is_pinned(p.ds_tensor):
            pinned = self.offload_device.host_tensor(p.ds_tensor.numel(), p.ds_tensor.dtype)
            pinned.copy_(p.ds_tensor)
            p.ds_tensor = pinned

    def allocate_flat(self, name: str, numel: int, dtype) -> Optional[torch.Tensor]:
        """A flat tensor for a param group's partitions, in the device (byte-addressable)."""
        if BYTE_ADDRESSABLE not in self.offload_device.capabilities:
            return None
        stored = self.offload_device.allocate(name, numel, dtype)
        self.stored.append(stored)
        return self.offload_device.tensor(stored)

    def locations(self) -> List[str]:
        found = [self.offload_device.location(s) for s in self.stored]
        return [f for f in found if f]

    def close(self) -> None:
        self.offload_device.close()


class _BufferedGather(GatherHandle):
    """Partitions being read into a swap buffer. The reads are only waited for in ``wait()``, where
    the all-gather starts from the buffer, so a prefetched gather's reads run while the modules
    before it compute; the buffer goes back when the all-gather is done. (All-gathers start in
    ``wait()`` order, which, like the gather order, is the same on every rank.)"""

    def __init__(self, partitioner: "SwappedParamPartitioner", params, buffer: torch.Tensor, reads, staged):
        self.partitioner = partitioner
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.buffer, self.reads, self.staged = buffer, reads, staged
        self.op, self.quantized, self.fulls, self.works, self.packed = None, [False] * len(params), [], [], None
        self.started = False
        self.done = False
        for p in params:
            p.ds_status = ZeroParamStatus.INFLIGHT
            p._ds_handle = self

    def buffers(self) -> List[torch.Tensor]:
        return [self.buffer] + (super().buffers() if self.started else [])

    def wait(self) -> None:
        if self.done:
            return
        partitioner = self.partitioner
        try:
            for work in self.reads:
                work.wait()
            partitioner._staged.update(self.staged)
            try:
                GatherHandle.__init__(self, partitioner, self.params)  # the all-gather, from the staged pieces
            finally:
                for key in self.staged:
                    partitioner._staged.pop(key, None)
            self.started = True
            super().wait()
        finally:
            self.done = True
            partitioner._finished(self)


class SwappedParamPartitioner(StoredParamPartitioner):
    """Partitions stored in a device that needs swap buffers, ``max_in_cpu`` elements resident."""

    KEY = "offload_param"

    def __init__(self, comm, rank, world_size, compute_device, *, device: OffloadDevice, config):
        super().__init__(comm, rank, world_size, compute_device, device=device)
        self.config = config
        self.adopted: "OrderedDict[int, torch.nn.Parameter]" = OrderedDict()
        self.swapped: Dict[int, Stored] = {}  # ds_id -> its stored partition
        self.pool: Optional[SwapBufferPool] = None
        self.reserved = False
        self._staged: Dict[int, torch.Tensor] = {}
        self._outstanding: List[_BufferedGather] = []
        self.reads = 0  # partitions read from the device (tests and benchmarks count them)

    def adopt(self, p, dtype=None) -> None:
        super().adopt(p, dtype=dtype)
        self.adopted[p.ds_id] = p

    def allocate_flat(self, name, numel, dtype) -> Optional[torch.Tensor]:
        return None  # each partition is stored (or resident) on its own

    # ------------------------------------------------------------------ swapping out
    def plan(self) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
        """(resident, swapped): parameters in adoption order, resident while their partitions total at
        most ``max_in_cpu`` elements."""
        resident, swapped, total = [], [], 0
        for p in self.adopted.values():
            k = p.ds_tensor.numel()
            if total + k <= int(self.config.max_in_cpu):
                resident.append(p)
                total += k
            else:
                swapped.append(p)
        return resident, swapped

    def swap_bytes(self) -> int:
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.plan()[1])

    def swap_out(self, names: Dict[int, str]) -> None:
        """Move every partition beyond ``max_in_cpu`` into the device (once, before training).
        ``names``: ds_id -> a readable name for stored tensors and messages."""
        if self.reserved:
            raise OffloadError("parameter partitions were already swapped out")
        _, swapped = self.plan()
        size = int(self.config.buffer_size)
        largest = max(swapped, key=lambda p: p.ds_tensor.numel()) if swapped else None
        if largest is not None and largest.ds_tensor.numel() > size:
            raise OffloadError(f"zero_optimization.offload_param.buffer_size = {size} elements is smaller than the "
                               f"partition of parameter {names.get(largest.ds_id, largest.ds_id)!r} "
                               f"({largest.ds_tensor.numel()} elements): raise buffer_size to at least that")
        self.offload_device.reserve(self.swap_bytes())  # the device checks its room before anything is written
        self.reserved = True
        if not swapped:
            return
        total = sum(p.ds_tensor.numel() for p in swapped)
        dtype = swapped[0].ds_tensor.dtype
        self.pool = SwapBufferPool(self.offload_device, int(self.config.buffer_count), min(size, total), dtype)
        works = []
        for p in swapped:
            stored = self.offload_device.allocate(f"param{p.ds_id}_{_safe(names.get(p.ds_id, ''))}",
                                                  p.ds_tensor.numel(), p.ds_tensor.dtype)
            self.swapped[p.ds_id] = stored
            works.append(self.offload_device.write(stored, p.ds_tensor.contiguous()))
        for work in works:
            work.wait()
        for p in swapped:
            p.ds_tensor = placeholder(p.ds_tensor.numel(), p.ds_tensor.dtype)

    def is_swapped(self, p) -> bool:
        return p.ds_id in self.swapped

    def locations(self) -> List[str]:
        found = [self.offload_device.location(s) for s in self.swapped.values()]
        return sorted(f for f in found if f)

    # ------------------------------------------------------------------ values
    def read_piece(self, p) -> torch.Tensor:
        if not self.is_swapped(p):
            return p.ds_tensor
        out = torch.empty(p.ds_tensor.numel(), dtype=p.ds_tensor.dtype)
        self.reads += 1
        self.offload_device.read(self.swapped[p.ds_id], out).wait()
        return out

    def store_piece(self, p, piece: torch.Tensor) -> None:
        self.store_pieces([(p, piece)])

    def store_pieces(self, items: Sequence[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Write new partition values: resident ones in place, swapped ones to the device."""
        works = []
        with torch.no_grad():
            for p, piece in items:
                if not self.is_swapped(p):
                    p.ds_tensor.copy_(piece)
                    continue
                value = piece.detach().to(device="cpu", dtype=p.ds_tensor.dtype).contiguous()
                if value.numel() != p.ds_tensor.numel():
                    raise ValueError(f"partition of {p.ds_numel} elements: got {value.numel()} values for "
                                     f"{p.ds_tensor.numel()}")
                if value.data_ptr() == piece.data_ptr():
                    value = value.clone()  # the caller may reuse its tensor before the write completes
                works.append(self.offload_device.write(self.swapped[p.ds_id], value))
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ gathering
    def local_piece(self, p) -> torch.Tensor:
        staged = self._staged.get(p.ds_id)
        if staged is not None:
            return staged if staged.device == self.device else staged.to(self.device, non_blocking=True)
        return super().local_piece(p)

    def gather_async(self, params: Iterable[torch.nn.Parameter]) -> List[GatherHandle]:
        handles: List[GatherHandle] = []
        for group in self._claim_for_gather(params):
            resident = [p for p in group if not self.is_swapped(p)]
            if resident:
                handles.append(GatherHandle(self, resident))
            chunk, used = [], 0
            for p in [p for p in group if self.is_swapped(p)] + [None]:
                k = p.ds_tensor.numel() if p is not None else 0
                if p is not None and used + k <= self.pool.numel:
                    chunk.append(p)
                    used += k
                    continue
                if chunk:
                    handles.append(self._gather_from_device(chunk))
                chunk, used = ([p], k) if p is not None else ([], 0)
        return handles

    def _gather_from_device(self, params: List[torch.nn.Parameter]) -> _BufferedGather:
        """Start reading ``params``' partitions into a free buffer (the gather itself starts on ``wait()``)."""
        while self.pool.free == 0:  # every buffer is in a gather in flight: complete the oldest
            self._outstanding[0].wait()
        buffer = self.pool.take()
        offset, works, staged = 0, [], {}
        try:
            for p in params:
                k = p.ds_tensor.numel()
                works.append(self.offload_device.read(self.swapped[p.ds_id], buffer[offset:offset + k]))
                staged[p.ds_id] = buffer[offset:offset + k]
                offset += k
            self.reads += len(params)
            handle = _BufferedGather(self, params, buffer, works, staged)
        except BaseException:
            for work in works:
                work.wait()
            self.pool.give(buffer)
            raise
        self._outstanding.append(handle)
        return handle

    def _finished(self, handle: _BufferedGather) -> None:
        if handle in self._outstanding:
            self._outstanding.remove(handle)
            self.pool.give(handle.buffer)

    # ------------------------------------------------------------------ lifecycle
    def resident_partitions(self) -> List[torch.Tensor]:
        return [p.ds_tensor for p in self.adopted.values() if not is_placeholder(p.ds_tensor)]

    def close(self) -> None:
        try:
            for handle in list(self._outstanding):
                handle.wait()
        finally:
            super().close()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
