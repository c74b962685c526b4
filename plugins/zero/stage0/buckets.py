"""Gradient buckets: average gradients over ranks while backward is still running.

Parameters are grouped, in the order backward produces their gradients (reverse registration
order), into buckets of at most ``bucket_elements`` elements. When every gradient of a bucket is
final, it is flattened into the bucket's buffer (in the communication dtype) and an asynchronous
all-reduce starts; a bucket of a single gradient is reduced where it is, without a buffer. After
the reduction a gradient of the communication dtype becomes a view of its piece of the buffer (as
DDP's ``gradient_as_bucket_view``), which saves copying every gradient back; the buffer is only
rewritten by the next reduction, after ``zero_grad`` has dropped those views (a gradient still
there is its own piece, and is not copied onto itself). Buckets always start in index order on
every rank — a bucket waits for all earlier ones — so the collectives of all ranks match even if
some parameter gets no gradient.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch


class GradientBuckets:
    """``group``: the process group to all-reduce in (None: ``comm``'s own); the sums are divided
    by ``world_size`` either way (a reduction's divisor: the data-parallel world size also for
    parameters summed over a smaller group: see
    :func:`dsplug.plugins.zero.partitioning.reductions.reduction_domains`)."""

    def __init__(self, params: List[torch.nn.Parameter], bucket_elements: int, comm, world_size: int, dtype,
                 prescale: bool, predivide: float, grad_of: Callable, set_grad: Callable, group=None):
        self.comm = comm
        self.group = group
        self.world_size = world_size
        self.dtype = dtype
        self.prescale = prescale
        self.predivide = float(predivide)
        self.grad_of = grad_of
        self.set_grad = set_grad
        self.buckets: List[List[torch.nn.Parameter]] = []
        current, size = [], 0
        for p in reversed(params):
            if current and size + p.numel() > bucket_elements:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            self.buckets.append(current)
        self.bucket_of: Dict[torch.nn.Parameter, int] = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self.start_round()

    def start_round(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.next_launch = 0
        self.works: List[object] = []

    def mark_ready(self, p) -> None:
        index = self.bucket_of.get(p)
        if index is None:
            return
        self.pending[index] -= 1
        while self.next_launch < len(self.buckets) and self.pending[self.next_launch] <= 0:
            self._launch(self.next_launch)
            self.next_launch += 1

    def finish_round(self) -> None:
        """Launch what is left (parameters without gradients count as zeros), wait, write back."""
        while self.next_launch < len(self.buckets):
            self._launch(self.next_launch)
            self.next_launch += 1
        for index, work, buf in self.works:
            if work is not None:
                work.wait()
            self._write_back(index, buf)
        self.works = []

    def _launch(self, index: int) -> None:
        params = self.buckets[index]
        grads = []
        for p in params:
            g = self.grad_of(p)
            if g is None:
                g = torch.zeros_like(p, dtype=self.dtype)
                self.set_grad(p, g)
            grads.append(g)
        if len(grads) == 1 and grads[0].dtype == self.dtype and grads[0].is_contiguous():
            buf = grads[0].view(-1)  # a bucket of one gradient is reduced where it is: nothing to copy
        else:
            buf = self._flatten(index, grads)
        if self.prescale:
            buf.div_(self.world_size)
        elif self.predivide != 1.0:
            buf.div_(self.predivide)
        self.works.append((index, self.comm.all_reduce(buf, group=self.group, async_op=True), buf))

    def _flatten(self, index: int, grads: List[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients in its buffer (kept between steps)."""
        numel = sum(g.numel() for g in grads)
        buf = self.buffers[index]
        if buf is None or buf.numel() != numel or buf.device != grads[0].device:
            buf = self.buffers[index] = torch.empty(numel, dtype=self.dtype, device=grads[0].device)
        offset = 0
        for g in grads:
            n = g.numel()
            piece = buf[offset:offset + n]
            if g.data_ptr() != piece.data_ptr() or g.dtype != buf.dtype:  # (else it is already there)
                piece.view_as(g).copy_(g)
            offset += n
        return buf

    def _write_back(self, index: int, buf: torch.Tensor) -> None:
        if not self.prescale:
            buf.mul_(self.predivide / self.world_size)
        offset = 0
        for p in self.buckets[index]:
            g = self.grad_of(p)
            n = g.numel()
            reduced = buf[offset:offset + n].view_as(g)
            if g.dtype == buf.dtype and g.is_contiguous():
                self.set_grad(p, reduced)  # the gradient becomes its piece of the bucket: no copy back
            else:
                g.copy_(reduced)
            offset += n
