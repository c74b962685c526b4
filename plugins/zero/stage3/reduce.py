"""Gradient reduce-scatter into the owners' partitions (ZeRO stage 3).

Full gradients arrive one parameter at a time during backward (from the stage's gradient hooks,
in the same order on every rank). They are collected into buckets of about
``reduce_bucket_size`` elements. A bucket is laid out rank-major — row r holds rank r's piece
of every gradient in the bucket, ``[A_r | B_r | ...]`` — so that one reduce-scatter leaves each
rank exactly its own pieces, which are added into its gradient partitions.

Averaging over ranks follows stage 0 (``plugins/zero/stage0/buckets.py``): ``prescale_gradients``
divides by N before the reduction, otherwise the sum is divided by ``gradient_predivide_factor``
before and multiplied by ``predivide / N`` after.

ZeRO++ qgZ (``zero_quantized_gradients``): the same bucket goes through
:class:`dsplug.plugins.zero.stage3.zeropp.QuantizedGradients` instead: an all-to-all of int8
block-quantized rows, dequantized and summed in fp32 by the receiving rank.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch


def rank_major_bucket(grads: List[torch.Tensor], sizes: List[int], world: int, dtype,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[world, sum(sizes)]``: row r holds rank r's piece (``sizes[i]`` elements, zero-padded) of
    every gradient, side by side. One copy of each gradient (no padded temporaries); into ``out``
    when given (a reused buffer of the right size: no fresh pages to fault in every step)."""
    bucket = out if out is not None else torch.empty(world, sum(sizes), dtype=dtype, device=grads[0].device)
    offset = 0
    for g, k in zip(grads, sizes):
        flat = g.reshape(-1)
        n = flat.numel()
        full_rows = n // k if k else 0
        if full_rows:
            bucket[:full_rows, offset:offset + k].copy_(flat[:full_rows * k].view(full_rows, k))
        if full_rows < world:
            rest = n - full_rows * k
            bucket[full_rows, offset:offset + rest].copy_(flat[full_rows * k:])
            bucket[full_rows, offset + rest:offset + k].zero_()
            bucket[full_rows + 1:, offset:offset + k].zero_()
        offset += k
    return bucket


class GradientReducer:
    #: reductions left in flight with ``overlap`` (the newest ones); a further bucket completes the oldest
    IN_FLIGHT = 2

    def __init__(self, comm, rank: int, world_size: int, dtype: torch.dtype, bucket_elements: int,
                 prescale: bool, predivide: float, use_reduce_scatter: bool, overlap: bool,
                 accumulate: Callable[[torch.nn.Parameter, torch.Tensor], None], quantized=None,
                 claim: Optional[Callable[[torch.nn.Parameter, torch.dtype], Optional[torch.Tensor]]] = None):
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.dtype = dtype
        self.bucket_elements = max(1, int(bucket_elements))
        self.prescale = prescale
        self.predivide = float(predivide)
        self.use_reduce_scatter = use_reduce_scatter
        self.overlap = overlap
        self.accumulate = accumulate
        #: ``claim(p, dtype)``: the parameter's gradient partition when it has that dtype and nothing
        #: is accumulated in it yet (its single-gradient reduction then writes straight into it), else None
        self.claim = claim
        #: ZeRO++ qgZ (a zeropp.QuantizedGradients), None for the plain reduce-scatter
        self.quantized = quantized
        self.pending: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.pending_elements = 0
        self.outstanding: list = []
        #: flat buffers of completed reductions, reused by the next buckets: a bucket and its reduced
        #: output live in one of them. A large fresh buffer is page-faulted in on every use on CPU
        #: (measured: ~0.6 ms per MB, more than the reduce-scatter's own time), and DeepSpeed also
        #: keeps its bucket buffer between steps. At most two are kept.
        self._free: List[torch.Tensor] = []

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        self.pending.append((p, grad))
        self.pending_elements += p.ds_tensor.numel() * self.world_size
        if self.pending_elements >= self.bucket_elements:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        world = self.world_size
        params = [p for p, _ in self.pending]
        sizes = [p.ds_tensor.numel() for p in params]
        grads = [g for _, g in self.pending]
        total = sum(sizes)
        single = grads[0]
        if len(grads) == 1 and self.quantized is None and single.numel() == world * total and \
                single.dtype == self.dtype and single.is_contiguous():
            # one gradient that splits evenly is already rank-major (row r: rank r's piece): reduced
            # from where it is (the stage owns it), only the output needs a buffer
            bucket = single.view(world, total)
            target = self.claim(params[0], self.dtype) if self.claim is not None and self.use_reduce_scatter else None
            if target is not None:
                whole, out = None, target  # into the gradient partition itself: nothing to accumulate after
            else:
                whole = self._take(total, single.device)
                out = whole[:total]
        else:
            whole = self._take(world * total + total, grads[0].device)
            flat = whole[:world * total + total]
            bucket = rank_major_bucket(grads, sizes, world, self.dtype, out=flat[:world * total].view(world, total))
            out = flat[world * total:]
        self.pending, self.pending_elements = [], 0
        if self.prescale:
            bucket.div_(world)
        elif self.predivide != 1.0:
            bucket.div_(self.predivide)
        finish = None
        if self.quantized is not None:
            work, mine, finish = self.quantized.start(bucket, sizes, async_op=self.overlap)
        elif self.use_reduce_scatter:
            mine = out
            work = self.comm.reduce_scatter_tensor(mine, bucket.view(-1), async_op=self.overlap)
        else:
            work = self.comm.all_reduce(bucket, async_op=self.overlap)
            mine = bucket[self.rank]
        # (the bucket is kept referenced until the reduction is complete: it may be the gradient itself)
        self.outstanding.append((work, mine, params, sizes, finish, whole, bucket))
        if not self.overlap:
            self._complete_all()
        elif len(self.outstanding) > self.IN_FLIGHT:
            # the oldest reduction has had a bucket's worth of backward to finish: take its result,
            # so that at most IN_FLIGHT buckets (and their buffers) are held, whatever the model size
            self._complete(self.outstanding[:len(self.outstanding) - self.IN_FLIGHT])

    def _take(self, numel: int, device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements: the smallest kept one that is large enough,
        else a new one."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel and b.device == device]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(numel, dtype=self.dtype, device=device)

    def kept_buffers(self) -> List[torch.Tensor]:
        return list(self._free)

    def in_flight_buffers(self) -> List[torch.Tensor]:
        """What the reductions in flight hold: their buffers, and a gradient reduced from where it is."""
        return [t for entry in self.outstanding for t in entry[5:] if t is not None]

    def finish(self) -> None:
        """Reduce what is left and wait for every reduction of this backward pass."""
        self.flush()
        self._complete_all()

    def _complete_all(self) -> None:
        in_flight = len(self.outstanding)
        self._complete(list(self.outstanding))
        # keep the largest one or two (double buffering when reductions overlap backward): with
        # overlap_comm every bucket of a pass is in flight until finish(), and keeping them all
        # would hold a whole gradient's worth between steps
        self._free = sorted(self._free, key=torch.Tensor.numel, reverse=True)[:min(max(in_flight, 1), 2)]

    def _complete(self, entries) -> None:
        """Wait for the reductions ``entries`` (the oldest in flight, in order) and accumulate them."""
        for entry in entries:
            self.outstanding.remove(entry)
            work, mine, params, sizes, finish, whole, _ = entry
            claimed = whole is None
            if finish is not None:
                mine = finish()  # waits, dequantizes and sums (fp32)
            elif work is not None:
                work.wait()
            if not self.prescale:
                mine.mul_(self.predivide / self.world_size)
            if claimed:
                continue
            offset = 0
            for p, k in zip(params, sizes):
                self.accumulate(p, mine[offset:offset + k])
                offset += k
            self._free.append(whole)
