"""Gradient partitions of swapped sub-groups kept in the ``offload_optimizer`` device (ZeRO-Infinity).

With ``offload_optimizer`` on a device that needs swap buffers (``nvme``) the fp32 master and the
optimizer state of the host share are swapped in per sub-group (:mod:`.offload_store`). Their
gradient partitions go the same way, so that no gradient of the host share is held in memory
between backward and the step (a flat fp32 gradient of a 3B-parameter model alone is 12 GB):

* during backward, each reduced piece is added into its sub-group's fp32 buffer (one from the
  store's swap-buffer pool; the sum is rounded to the accumulation dtype, bf16 by default under
  bf16, as the in-memory partitions), opened on the sub-group's first piece: zeros at the first
  micro-step of an accumulation window, else the sub-group's gradient read back from the device;
* when every piece of the sub-group that takes a gradient has arrived, the buffer's squared norm
  is recorded and it is written to the device (write stream :data:`STREAM`, overlapping the rest of
  backward); with every buffer in use, the oldest open sub-group is written early and read back
  if more of its pieces arrive;
* at the step, the store reads the sub-group's gradient beside its master and state
  (:meth:`SwappedGradients.read`) and scales it by :attr:`SwappedGradients.factor` (the loss-scale
  unscaling and the clipping coefficient, which the stage folds in instead of touching the
  partitions: :meth:`scale`). The global norm uses the recorded squares (:meth:`squares`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from dsplug.contracts.offload import OffloadError, Work

FP32 = torch.float32
#: the write stream of gradient writes (the step's sub-group writes use streams 0 and 1)
STREAM = 2


class SwappedGradients:
    """The fp32 gradient partitions of ``store``'s swapped sub-groups (see the module doc)."""

    def __init__(self, store, requires_grad: Dict[Tuple[int, int], bool]):
        self.store = store
        self.device = store.opt_device
        #: (group, piece) -> (unit, start, end) of the piece in its unit
        self.where: Dict[Tuple[int, int], tuple] = {}
        #: unit key -> pieces that receive a gradient in a backward pass
        self.expected: Dict[Tuple[int, int], int] = {}
        for u in store.units:
            self.expected[(u.gi, u.si)] = 0
            for i, (a, b) in zip(u.indices, u.ranges):
                self.where[(u.gi, i)] = (u, a, b)
                self.expected[(u.gi, u.si)] += bool(requires_grad.get((u.gi, i), True))
        self.open: "OrderedDict[Tuple[int, int], list]" = OrderedDict()  # key -> [unit, buffer, arrived]
        self.on_disk: set = set()  # units whose stored gradient holds this window's sum so far
        self._squares: Dict[Tuple[int, int], float] = {}
        self._writes: List[Tuple[torch.Tensor, Work]] = []
        #: multiplier the step applies to the gradients it reads (unscaling, clipping)
        self.factor = 1.0

    def covers(self, gi: int, i: int) -> bool:
        return (gi, i) in self.where

    def _stored(self, u):
        return self.store._stored(u, "grad")

    # ------------------------------------------------------------------ backward
    def add(self, gi: int, i: int, piece: torch.Tensor) -> None:
        """Add the reduced gradient ``piece`` of piece ``i`` of group ``gi``."""
        u, a, b = self.where[(gi, i)]
        key = (u.gi, u.si)
        entry = self.open.get(key)
        if entry is None:
            entry = self.open[key] = [u, self._open(u), 0]
        piece = piece.reshape(-1).to(device="cpu")
        target = entry[1][a:b]
        dtype = self.store.groups[gi].grad_dtype
        if dtype == FP32:
            target.add_(piece)
        else:  # accumulate in the accumulation dtype (bf16 / fp16), as the in-memory partitions do
            target.copy_(target.to(dtype).add_(piece.to(dtype)))
        entry[2] += 1
        if entry[2] >= self.expected[key]:
            self._close(key)

    def _open(self, u) -> torch.Tensor:
        buffer = self._take()[:u.numel * 4].view(FP32)
        if (u.gi, u.si) in self.on_disk:
            self._wait_writes()  # its last write may still be in flight
            self.device.read(self._stored(u), buffer).wait()
        else:
            buffer.zero_()
        return buffer

    def _take(self) -> torch.Tensor:
        pool = self.store.pool
        while pool.free == 0:
            if self._writes:
                buffer, work = self._writes.pop(0)
                work.wait()
                pool.give(buffer)
            elif self.open:
                self._close(next(iter(self.open)))  # every buffer holds an open sub-group: write the oldest
            else:
                raise OffloadError("no swap buffer free for a gradient sub-group")
        return pool.take()

    def _close(self, key) -> None:
        u, buffer, _ = self.open.pop(key)
        self._squares[key] = float(torch.linalg.vector_norm(buffer, dtype=torch.float64)) ** 2
        self._writes.append((buffer, self.device.write(self._stored(u), buffer, STREAM)))
        self.on_disk.add(key)

    def _wait_writes(self) -> None:
        writes, self._writes = self._writes, []
        for buffer, work in writes:
            work.wait()
        for buffer, _ in writes:
            self.store.pool.give(buffer)  # (a view of the buffer: same data pointer)

    def end_backward(self) -> None:
        """Write the sub-groups still open (pieces without a gradient this pass) and wait for the writes."""
        for key in list(self.open):
            self._close(key)
        self._wait_writes()

    # ------------------------------------------------------------------ step
    def squares(self) -> float:
        """Sum of the squared gradients of this rank's swapped sub-groups, ``factor`` applied."""
        return sum(self._squares.values()) * self.factor ** 2

    def scale(self, factor: float) -> None:
        self.factor *= float(factor)

    def read(self, u, buffer: torch.Tensor) -> Optional[Work]:
        """Start reading unit ``u``'s gradient into ``buffer`` (fp32, ``u.numel``); zeros (and None)
        when it received none this window. Apply :meth:`finish_read` after the read is waited for."""
        if (u.gi, u.si) in self.on_disk:
            return self.device.read(self._stored(u), buffer)
        buffer.zero_()
        return None

    def finish_read(self, buffer: torch.Tensor) -> None:
        if self.factor != 1.0:
            buffer.mul_(self.factor)

    def piece(self, gi: int, i: int) -> torch.Tensor:
        """Piece ``i`` of group ``gi``'s accumulated gradient (a fresh fp32 tensor, ``factor`` not applied)."""
        u, a, b = self.where[(gi, i)]
        key = (u.gi, u.si)
        if key in self.open:
            return self.open[key][1][a:b].clone()
        if key not in self.on_disk:
            return torch.zeros(b - a, dtype=FP32)
        self._wait_writes()
        whole = torch.empty(u.numel, dtype=FP32)
        self.device.read(self._stored(u), whole).wait()
        return whole[a:b].clone()

    def has_gradients(self) -> bool:
        return bool(self.on_disk or self.open)

    def reset(self) -> None:
        """The window's gradients are consumed (or dropped): the next backward starts from zero."""
        for key in list(self.open):
            u, buffer, _ = self.open.pop(key)
            self.store.pool.give(buffer)  # (a view of the buffer: same data pointer)
        self._wait_writes()
        self.on_disk.clear()
        self._squares.clear()
        self.factor = 1.0

    def memory_tensors(self) -> List[torch.Tensor]:
        return [entry[1] for entry in self.open.values()]

