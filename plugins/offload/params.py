"""Stage 3 parameter partitions off the accelerator (``offload_param``).

* :class:`HostParamPartitioner` (``device: cpu``): partitions live in host memory (page-locked with
  ``pin_memory`` where an accelerator exists); :meth:`local_piece` copies a partition to the
  accelerator just before it is all-gathered.
* :class:`NvmeParamPartitioner` (``device: nvme``): the first parameters, up to ``max_in_cpu``
  partition elements in all, stay in host memory; every other partition lives in its own swap file
  and ``p.ds_tensor`` is a placeholder without memory (:func:`~.swap.placeholder`). A gather reads
  the partitions into ``buffer_count`` buffers of ``buffer_size`` elements (several small
  partitions share a buffer), sends from there and gives the buffer back when the all-gather is
  waited for; with every buffer in use, the oldest gather is completed first. Writes (the updated
  partitions after a step, ``GatheredParameters`` with a modifier rank, module loads) go through
  :meth:`store_piece` / :meth:`store_pieces`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from dsplug.plugins.zero.stage3.partitioned_param import GatherHandle, ParamPartitioner

from .swap import BufferPool, SwapDir, SwapError, SwapFiles, is_placeholder, placeholder


class HostParamPartitioner(ParamPartitioner):
    """Partitions in host memory (``offload_param.device: cpu``)."""

    def __init__(self, comm, rank, world_size, device, *, accelerator=None, pin_memory: bool = False):
        super().__init__(comm, rank, world_size, device, partition_device="cpu")
        self.accelerator = accelerator
        self.pin = bool(pin_memory) and accelerator is not None and accelerator.name != "cpu"

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked memory when pinning applies."""
        return self.accelerator.pin_memory(tensor) if self.pin else tensor

    def adopt(self, p, dtype=None) -> None:
        super().adopt(p, dtype=dtype)
        if self.pin and not self.accelerator.is_pinned(p.ds_tensor):
            p.ds_tensor = self.host_tensor(p.ds_tensor)


class _BufferedGather(GatherHandle):
    """A gather whose partitions were read into a swap buffer: the buffer goes back on ``wait()``."""

    def __init__(self, partitioner: "NvmeParamPartitioner", params, buffer: torch.Tensor):
        self.buffer = buffer
        super().__init__(partitioner, params)

    def wait(self) -> None:
        if self.done:
            return
        super().wait()
        self.partitioner._finished(self)


class NvmeParamPartitioner(HostParamPartitioner):
    """Partitions in swap files (``offload_param.device: nvme``), ``max_in_cpu`` elements resident."""

    KEY = "offload_param"

    def __init__(self, comm, rank, world_size, device, *, config, aio_config=None, accelerator=None):
        super().__init__(comm, rank, world_size, device, accelerator=accelerator, pin_memory=config.pin_memory)
        self.config = config
        self.aio_config = aio_config
        self.adopted: "OrderedDict[int, torch.nn.Parameter]" = OrderedDict()
        self.swapped: Dict[int, str] = {}  # ds_id -> file name
        self.dir: Optional[SwapDir] = None
        self.files: Optional[SwapFiles] = None
        self.pool: Optional[BufferPool] = None
        self._staged: Dict[int, torch.Tensor] = {}
        self._outstanding: List[_BufferedGather] = []
        self.reads = 0  # partitions read from files (tests and benchmarks count them)

    def adopt(self, p, dtype=None) -> None:
        super().adopt(p, dtype=dtype)
        self.adopted[p.ds_id] = p

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
        """Move every partition beyond ``max_in_cpu`` into its swap file (once, before training).
        ``names``: ds_id -> a readable name for files and messages."""
        if self.dir is not None:
            raise SwapError("parameter partitions were already swapped out")
        _, swapped = self.plan()
        size = int(self.config.buffer_size)
        largest = max(swapped, key=lambda p: p.ds_tensor.numel()) if swapped else None
        if largest is not None and largest.ds_tensor.numel() > size:
            raise SwapError(f"zero_optimization.offload_param.buffer_size = {size} elements is smaller than the "
                            f"partition of parameter {names.get(largest.ds_id, largest.ds_id)!r} "
                            f"({largest.ds_tensor.numel()} elements): raise buffer_size to at least that")
        self.dir = SwapDir(self.config.nvme_path, self.KEY, self.rank, self.swap_bytes())  # checks the path
        if not swapped:
            return
        total = sum(p.ds_tensor.numel() for p in swapped)
        self.files = SwapFiles(self.dir, self.aio_config)
        dtype = swapped[0].ds_tensor.dtype
        self.pool = BufferPool(int(self.config.buffer_count), min(size, total), dtype, self.accelerator, self.pin)
        for p in swapped:
            name = f"param{p.ds_id}_{_safe(names.get(p.ds_id, ''))}.swp"
            self.swapped[p.ds_id] = name
            self.files.write(p.ds_tensor.contiguous(), name)
        self.files.wait_writes()
        for p in swapped:
            p.ds_tensor = placeholder(p.ds_tensor.numel(), p.ds_tensor.dtype)

    def is_swapped(self, p) -> bool:
        return p.ds_id in self.swapped

    # ------------------------------------------------------------------ values
    def read_piece(self, p) -> torch.Tensor:
        if not self.is_swapped(p):
            return p.ds_tensor
        out = torch.empty(p.ds_tensor.numel(), dtype=p.ds_tensor.dtype)
        self.reads += 1
        return self.files.read_now(out, self.swapped[p.ds_id])

    def store_piece(self, p, piece: torch.Tensor) -> None:
        self.store_pieces([(p, piece)])

    def store_pieces(self, items: Sequence[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Write new partition values: resident ones in place, swapped ones to their files."""
        pending = False
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
                self.files.write(value, self.swapped[p.ds_id])
                pending = True
        if pending:
            self.files.wait_writes()

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
                    handles.append(self._gather_from_files(chunk))
                chunk, used = ([p], k) if p is not None else ([], 0)
        return handles

    def _gather_from_files(self, params: List[torch.nn.Parameter]) -> _BufferedGather:
        while self.pool.free == 0:  # every buffer is in a gather in flight: complete the oldest
            self._outstanding[0].wait()
        buffer = self.pool.take()
        offset = 0
        for p in params:
            k = p.ds_tensor.numel()
            self.files.read(buffer[offset:offset + k], self.swapped[p.ds_id])
            self._staged[p.ds_id] = buffer[offset:offset + k]
            offset += k
        self.reads += len(params)
        try:
            self.files.wait_reads()
            handle = _BufferedGather(self, params, buffer)
        except BaseException:
            self.pool.give(buffer)
            raise
        finally:
            self._staged.clear()
        self._outstanding.append(handle)
        return handle

    def _finished(self, handle: _BufferedGather) -> None:
        self._outstanding.remove(handle)
        self.pool.give(handle.buffer)

    # ------------------------------------------------------------------ lifecycle
    def resident_partitions(self) -> List[torch.Tensor]:
        return [p.ds_tensor for p in self.adopted.values() if not is_placeholder(p.ds_tensor)]

    def close(self) -> None:
        for handle in list(self._outstanding):
            handle.wait()
        if self.files is not None:
            self.files.close()
        if self.dir is not None:
            self.dir.close()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
