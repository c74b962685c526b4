"""Bucketed reduction of gradients into their owners' partitions (ZeRO stages 1 and 2).

Parameters are grouped, in the order backward produces their gradients (reverse module order),
into buckets of at most ``reduce_bucket_size`` elements (a larger parameter is a bucket of its
own). A bucket's buffer is laid out by owner: first every piece of its gradients that falls into
rank 0's partition, then rank 1's, ... When every gradient of a bucket has arrived, the bucket is
averaged over the ranks:

* ``reduce_scatter=True``: each owner's segment is *reduced* to its owner (one ``reduce`` per
  owner present in the bucket; this is how DeepSpeed reduce-scatters partitions of unequal size),
* ``reduce_scatter=False``: the whole bucket is all-reduced.

The owner then adds its segment into its gradient partition; the rest is dropped.

``overlap_comm``: the reductions are launched asynchronously and backward continues; up to two
buckets are in flight (double buffering). Without it each bucket's reduction completes before
backward goes on. ``contiguous_gradients``: gradients are copied, as they are produced, into a
preallocated bucket buffer (one, or two with ``overlap_comm``) reused for every bucket, and the
parameter's own gradient is released at once. Without it the gradients stay where autograd put
them until their bucket is complete, and each bucket is flattened into a freshly allocated buffer.

Buckets are launched (and buffers taken) in bucket order on every rank, so the collectives of all
ranks match even when some parameter gets no gradient (it counts as zeros).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..partitioning.flat import FlatGroup


class ReduceBucket:
    """Static description of one bucket: where each gradient piece goes in its buffer.

    slots:    param -> [(buffer offset, offset in the flattened parameter, length)]
    segments: [(owner rank, buffer offset, length)] (only owners with a non-empty segment)
    owned:    {rank: [(group index, start in the partition, buffer offset, length)]}: merged runs
    """

    def __init__(self, params: List[torch.nn.Parameter], group_of: Dict[torch.nn.Parameter, FlatGroup]):
        self.params = params
        entries = []
        for p in params:
            group = group_of[p]
            param_offset = 0
            for owner, start, length in group.pieces(p):
                entries.append((owner, group.index, start, length, p, param_offset))
                param_offset += length
        entries.sort(key=lambda e: (e[0], e[1], e[2]))
        self.slots: Dict[torch.nn.Parameter, List[Tuple[int, int, int]]] = {p: [] for p in params}
        self.segments: List[Tuple[int, int, int]] = []
        self.owned: Dict[int, List[List[int]]] = {}
        offset = 0
        for owner, gi, start, length, p, param_offset in entries:
            self.slots[p].append((offset, param_offset, length))
            if self.segments and self.segments[-1][0] == owner:
                o, s, n = self.segments[-1]
                self.segments[-1] = (o, s, n + length)
            else:
                self.segments.append((owner, offset, length))
            runs = self.owned.setdefault(owner, [])
            last = runs[-1] if runs else None
            if last is not None and last[0] == gi and last[1] + last[3] == start and last[2] + last[3] == offset:
                last[3] += length
            else:
                runs.append([gi, start, offset, length])
            offset += length
        self.numel = offset


def make_buckets(order: Sequence[torch.nn.Parameter], group_of, bucket_elements: int) -> List[ReduceBucket]:
    """Greedy buckets over ``order``: close a bucket when the next parameter would overflow it."""
    buckets, current, size = [], [], 0
    for p in order:
        if current and size + p.numel() > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
    return [ReduceBucket(b, group_of) for b in buckets]


class FlatGradientReducer:
    """Runs one reduction round per backward pass (see the module docstring).

    grad_of(p):  the gradient to reduce for ``p`` (or None: none was produced)
    release(p):  drop ``p``'s gradient once it is in a bucket buffer
    deliver(group_index, start, values): hand ``values`` to this rank's gradient partition of that
        group at ``start``; every element of the partition is delivered exactly once per round
    divisor: the sums are divided by it (default ``world_size``)
    """

    def __init__(self, groups: List[FlatGroup], order: Sequence[torch.nn.Parameter], bucket_elements: int, comm,
                 rank: int, world_size: int, dtype: torch.dtype, device, *, prescale: bool, predivide: float,
                 reduce_scatter: bool, overlap: bool, contiguous: bool, grad_of: Callable, release: Callable,
                 deliver: Callable, divisor: Optional[int] = None):
        self.group_of = {p: g for g in groups for p in g.params}
        self.buckets = make_buckets(order, self.group_of, bucket_elements)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        self.comm, self.rank, self.world_size = comm, rank, world_size
        #: what the sums are divided by: the world size, or a reduction's divisor (the data-parallel
        #: world size for parameters summed over a smaller group: dsplug_param_reduction)
        self.divisor = divisor or world_size
        self.dtype, self.device = dtype, device
        self.prescale, self.predivide = prescale, float(predivide)
        self.reduce_scatter, self.overlap, self.contiguous = reduce_scatter, overlap, contiguous
        self.grad_of, self.release, self.deliver = grad_of, release, deliver
        self.pool_size = 2 if overlap else 1
        self.buffer_numel = max((b.numel for b in self.buckets), default=0)
        self.pool: List[torch.Tensor] = []  # preallocated buffers (contiguous_gradients)
        self.free: List[torch.Tensor] = []
        self.start_round()

    # ------------------------------------------------------------------ round
    def start_round(self) -> None:
        """Forget the current round (waiting for any reduction still in flight first)."""
        for _, works, _ in getattr(self, "in_flight", ()):
            for work in works:
                if work is not None:
                    work.wait()
        n = len(self.buckets)
        self.pending = [len(b.params) for b in self.buckets]
        self.seen: set = set()
        self.waiting: List[List[torch.nn.Parameter]] = [[] for _ in range(n)]  # arrived, no buffer yet
        self.filled: List[set] = [set() for _ in range(n)]  # gradients already in the bucket buffer
        self.buffer_of: List[Optional[torch.Tensor]] = [None] * n
        self.next_launch = 0
        self.next_buffered = 0
        self.in_flight: deque = deque()
        self.free = list(self.pool)

    def on_grad(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient of this round is final."""
        index = self.bucket_of.get(p)
        if index is None or p in self.seen:
            return
        self.seen.add(p)
        self.pending[index] -= 1
        if self.world_size == 1:
            self._deliver_local(p)
            return
        if self.contiguous:
            self._assign_buffers(upto=index)
        if self.buffer_of[index] is not None:
            self._copy_in(index, p)
        else:
            self.waiting[index].append(p)
        while self.next_launch < len(self.buckets) and self.pending[self.next_launch] == 0:
            self._launch(self.next_launch)
            self.next_launch += 1

    def backward_params(self) -> List[torch.nn.Parameter]:
        """Every parameter, in bucket order (the expected order of backward)."""
        return [p for b in self.buckets for p in b.params]

    def missing(self) -> List[torch.nn.Parameter]:
        """Parameters that have produced no gradient in this round."""
        return [p for b in self.buckets for p in b.params if p not in self.seen]

    def finish_round(self) -> None:
        """Launch what is left (missing gradients count as zeros) and complete every reduction."""
        if self.world_size > 1:
            while self.next_launch < len(self.buckets):
                self._launch(self.next_launch)
                self.next_launch += 1
            while self.in_flight:
                self._complete_oldest()
        else:
            for p in self.missing():
                group = self.group_of[p]
                for _, start, length in group.pieces(p):
                    self.deliver(group.index, start, torch.zeros(length, dtype=self.dtype, device=self.device))
        self.start_round()

    # ------------------------------------------------------------------ buffers
    def _acquire(self) -> Optional[torch.Tensor]:
        if self.free:
            return self.free.pop()
        if len(self.pool) < self.pool_size:
            buf = torch.empty(self.buffer_numel, dtype=self.dtype, device=self.device)
            self.pool.append(buf)
            return buf
        if self.in_flight:
            self._complete_oldest()
            return self.free.pop()
        return None  # every buffer belongs to a bucket that is still filling

    def _assign_buffers(self, upto: int) -> None:
        """Give buffers to buckets ``next_buffered..upto``, in order, while one can be had."""
        while self.next_buffered <= upto:
            buf = self._acquire()
            if buf is None:
                return
            index = self.next_buffered
            self.buffer_of[index] = buf[:self.buckets[index].numel]
            self.next_buffered += 1
            for q in self.waiting[index]:
                self._copy_in(index, q)
            self.waiting[index] = []

    def _copy_in(self, index: int, p) -> None:
        buf = self.buffer_of[index]
        slots = self.buckets[index].slots[p]
        grad = self.grad_of(p)
        if grad is None:
            for offset, _, length in slots:
                buf[offset:offset + length].zero_()
        else:
            flat = grad.reshape(-1)
            for offset, param_offset, length in slots:
                buf[offset:offset + length].copy_(flat[param_offset:param_offset + length])
            self.release(p)
        self.filled[index].add(p)

    def _deliver_local(self, p) -> None:
        grad = self.grad_of(p)
        if grad is None:
            return
        group = self.group_of[p]
        flat = grad.reshape(-1)
        if self.divisor != 1:  # a reduction group of one rank under a larger data-parallel world
            flat = flat / self.divisor
        offset = 0
        for _, start, length in group.pieces(p):
            self.deliver(group.index, start, flat[offset:offset + length])
            offset += length
        self.release(p)

    # ------------------------------------------------------------------ collectives
    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.contiguous:
            self._assign_buffers(upto=index)
            if self.buffer_of[index] is None:  # cannot happen: earlier buckets are launched
                raise RuntimeError("internal error: no bucket buffer for a bucket being launched")
        else:
            self.buffer_of[index] = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            for q in self.waiting[index]:
                self._copy_in(index, q)
            self.waiting[index] = []
        buf = self.buffer_of[index]
        for p in bucket.params:
            if p not in self.filled[index]:
                self._copy_in(index, p)  # no gradient this round: zeros
        if self.prescale:
            buf.div_(self.divisor)
        elif self.predivide != 1.0:
            buf.div_(self.predivide)
        if self.reduce_scatter:
            works = [self.comm.reduce(buf[start:start + length], dst=owner, async_op=self.overlap)
                     for owner, start, length in bucket.segments]
        else:
            works = [self.comm.all_reduce(buf, async_op=self.overlap)]
        self.in_flight.append((index, works, buf))
        if not self.overlap:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        index, works, buf = self.in_flight.popleft()
        for work in works:
            if work is not None:
                work.wait()
        post = 1.0 if self.prescale else self.predivide / self.divisor
        for gi, start, offset, length in self.buckets[index].owned.get(self.rank, []):
            values = buf[offset:offset + length]
            if post != 1.0:
                values.mul_(post)
            self.deliver(gi, start, values)
        self.buffer_of[index] = None
        if self.contiguous:
            self.free.append(next(b for b in self.pool if b.data_ptr() == buf.data_ptr()))

    # ------------------------------------------------------------------ accounting
    def buffer_bytes(self) -> int:
        """Bytes of bucket buffers held now (the preallocated pool, or buffers in flight)."""
        held = list(self.pool) if self.contiguous else [buf for _, _, buf in self.in_flight]
        return sum(t.numel() * t.element_size() for t in held)


class ReducerSet:
    """The reducers of several reduction domains (the data-parallel group, each group a plugin
    averages parameters in) driven as one: a parameter goes to the reducer of its domain."""

    def __init__(self, reducers: List[FlatGradientReducer]):
        self.reducers = reducers
        self.of = {p: r for r in reducers for p in r.group_of}

    def on_grad(self, p) -> None:
        self.of[p].on_grad(p)

    def backward_params(self) -> List[torch.nn.Parameter]:
        return [p for r in self.reducers for p in r.backward_params()]

    def missing(self) -> List[torch.nn.Parameter]:
        return [p for r in self.reducers for p in r.missing()]

    def start_round(self) -> None:
        for r in self.reducers:
            r.start_round()

    def finish_round(self) -> None:
        for r in self.reducers:
            r.finish_round()

    def buffer_bytes(self) -> int:
        return sum(r.buffer_bytes() for r in self.reducers)
