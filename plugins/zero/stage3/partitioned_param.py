"""Partitioned parameters: how ZeRO stage 3 represents a ``torch.nn.Parameter``.

A partitioned parameter keeps only this rank's slice of its elements in ``param.ds_tensor``
(1-D); ``param.data`` is an empty placeholder until the full value is gathered. The slicing is
the ``per_param`` layout of docs/zero-stages.md: a parameter of n elements is padded with zeros
to a multiple of the world size N, and rank r owns elements ``[r*k, (r+1)*k)``, ``k = ceil(n/N)``.

Attributes set on every partitioned parameter (DeepSpeed's names, which user scripts and the
Hugging Face integration read): ``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``,
``ds_status`` (:class:`ZeroParamStatus`) and ``ds_persist`` (always whole: never released).

:class:`ParamPartitioner` converts parameters and moves them between the states::

    NOT_AVAILABLE --gather--> INFLIGHT --wait--> AVAILABLE --release--> NOT_AVAILABLE

A gather of several parameters issues one asynchronous all-gather per large parameter (at least
``PER_PARAM_GATHER_NUMEL`` elements), straight from its partition into its full buffer
(``[A_0 | A_1 | ...]``, the parameter's padded elements), and one packed all-gather for all the
small ones: each rank sends its small pieces concatenated (``[A_r | B_r]``) and the rank-major
result ``[A_0 B_0 | A_1 B_1 | ...]`` is copied apart by columns. Packing saves a message per
small parameter; for a large one its two copies would cost more than the message (measured at
50M parameters on 2 gloo ranks: forward 300 ms all packed, 182 ms per parameter).

ZeRO++ (:mod:`dsplug.plugins.zero.stage3.zeropp`): the stage sets :attr:`ParamPartitioner.wire`; the
gathers the coordinator starts for forward / backward (inside :meth:`ParamPartitioner.computing`)
then go through it (int8 block-quantized weights, hpZ's in-group gather from the secondary
shard). Every other gather (``GatheredParameters``, module state dicts, persistent parameters) is
exact, and :meth:`ParamPartitioner.fetch` re-gathers a parameter whose full value came from a
quantized gather.

The seam for offloading (``offload_param``, :mod:`.offload_params`): the partition lives on
``partition_device`` (or in an offload device's storage, :meth:`~ParamPartitioner.allocate_flat`)
and is brought to the compute device by :meth:`ParamPartitioner.local_piece` just before it is
sent; its values are read with :meth:`~ParamPartitioner.read_piece` and rewritten with
:meth:`~ParamPartitioner.store_piece`, which the subclass for devices that need swap buffers
overrides (with ``gather_async``).
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import math
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional

import torch

_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # the full value is in param.data
    NOT_AVAILABLE = 2  # only the partition exists
    INFLIGHT = 3  # an all-gather is on its way


def is_partitioned(param) -> bool:
    return hasattr(param, "ds_id")


def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank owns of a parameter with ``numel`` elements: ``ceil(numel / N)``."""
    return math.ceil(numel / world_size)


def piece_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` in the per_param layout (zero-padded, 1-D, a copy)."""
    flat = full.reshape(-1)
    k = partition_numel(flat.numel(), world_size)
    out = torch.zeros(k, dtype=full.dtype, device=full.device)
    start, stop = rank * k, min((rank + 1) * k, flat.numel())
    if stop > start:
        out[: stop - start].copy_(flat[start:stop])
    return out


def unique(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def start_all_gather(comm, pieces: List[torch.Tensor], world: int, dtype, device, group=None):
    """Start one all-gather of the concatenated ``pieces`` (this rank's row) over ``group``;
    returns ``(work, recv)`` with ``recv`` rank-major (``world`` rows)."""
    total = sum(t.numel() for t in pieces)
    send = pieces[0].reshape(-1) if len(pieces) == 1 else torch.cat([t.reshape(-1) for t in pieces])
    recv = torch.empty(world * total, dtype=dtype, device=device)
    work = comm.all_gather_into_tensor(recv, send, group=group, async_op=True) if total else None
    return work, recv


def split_rank_major(recv: torch.Tensor, world: int, sizes: List[int]) -> List[torch.Tensor]:
    """The rank-major ``[A_0 B_0 | A_1 B_1 | ...]`` as one flat ``[A_0 A_1 ... | B_0 B_1 ...]`` per column."""
    if len(sizes) == 1:
        return [recv]
    matrix = recv.view(world, sum(sizes))
    fulls, offset = [], 0
    for k in sizes:
        full = torch.empty(world * k, dtype=recv.dtype, device=recv.device)
        full.view(world, k).copy_(matrix[:, offset:offset + k])
        fulls.append(full)
        offset += k
    return fulls


#: parameters of at least this many (padded) elements are gathered on their own, the rest packed
PER_PARAM_GATHER_NUMEL = 1 << 18


def _storage_references(t: torch.Tensor) -> int:
    storage = t.untyped_storage()  # held while counted (it adds one reference of its own)
    return torch._C._storage_Use_Count(storage._cdata)


def _sole_reference(full: torch.Tensor) -> bool:
    """Whether nothing but ``full`` itself holds its memory (no view saved by autograd, held by a
    collective or kept by the user): only then may another parameter's gather overwrite it."""
    try:
        return _storage_references(full) == _SOLE_REFERENCES
    except (AttributeError, RuntimeError):  # a torch without the count: keep nothing
        return False


def _references_of_a_lone_tensor() -> int:
    try:
        return _storage_references(torch.empty(1))
    except (AttributeError, RuntimeError):
        return -1


_SOLE_REFERENCES = _references_of_a_lone_tensor()


class GatherHandle:
    """The all-gathers of several partitioned parameters of one dtype; ``wait()`` fills them in.

    Started inside :meth:`ParamPartitioner.computing` with a ZeRO++ ``wire`` set, the wire moves
    the values instead (see :mod:`dsplug.plugins.zero.stage3.zeropp`)."""

    def __init__(self, partitioner: "ParamPartitioner", params: List[torch.nn.Parameter]):
        self.partitioner = partitioner
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        dtype = params[0].ds_tensor.dtype
        device = partitioner.device
        wire = partitioner.wire if partitioner._computing else None
        self.op = None
        self.quantized = [False] * len(params)
        self.fulls: List[Optional[torch.Tensor]] = [None] * len(params)
        self.works: list = []
        self.packed = None  # (work, rank-major receive buffer, indices) of the small parameters
        if wire is not None:
            self.op = wire.start(partitioner, params)
        else:
            world = partitioner.world_size
            small = [i for i, k in enumerate(self.sizes) if world * k < PER_PARAM_GATHER_NUMEL]
            if small:
                pieces = [partitioner.local_piece(params[i]) for i in small]
                self.packed = start_all_gather(partitioner.comm, pieces, world, dtype, device) + (small,)
            for i, (p, k) in enumerate(zip(params, self.sizes)):
                if world * k >= PER_PARAM_GATHER_NUMEL:
                    full = self.fulls[i] = partitioner.full_buffer(world * k, dtype)
                    self.works.append(partitioner.comm.all_gather_into_tensor(
                        full, partitioner.local_piece(p), async_op=True))
        self.done = False
        for p in params:
            p.ds_status = ZeroParamStatus.INFLIGHT
            p._ds_handle = self

    def buffers(self) -> List[torch.Tensor]:
        """The receive buffers of the gather while it is in flight."""
        if self.done:
            return []
        if self.op is not None:
            return list(self.op.buffer)
        return [t for t in self.fulls if t is not None] + ([self.packed[1]] if self.packed else [])

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self.op is not None:
            fulls, self.quantized = self.op.finish()
        else:
            for work in self.works:
                work.wait()
            if self.packed is not None:
                work, recv, small = self.packed
                if work is not None:
                    work.wait()
                for i, full in zip(small, split_rank_major(recv, self.partitioner.world_size,
                                                           [self.sizes[i] for i in small])):
                    self.fulls[i] = full
            fulls = self.fulls
        reusable = self.op is None and self.works  # the per-parameter buffers (not packed, not ZeRO++)
        for i, (p, full, quantized) in enumerate(zip(self.params, fulls, self.quantized)):
            p.data = full[: p.ds_numel].view(p.ds_shape)
            p._ds_full = full if reusable and self.sizes[i] * self.partitioner.world_size >= PER_PARAM_GATHER_NUMEL \
                else None
            p.ds_status = ZeroParamStatus.AVAILABLE
            p._ds_handle = None
            p._ds_quantized = quantized
            if not p.ds_persist:
                self.partitioner.inflight_numel -= p.ds_numel
        self.fulls, self.works, self.op, self.packed = [], [], None, None


class ParamPartitioner:
    """Partitions parameters and gathers / releases them through the comm layer.

    comm:             the :mod:`dsplug.comm` layer (every collective goes through it)
    rank, world_size: this process's place in the data-parallel group
    device:           the compute device (where gathered parameters live)
    partition_device: where partitions live (the compute device unless offloaded)
    """

    def __init__(self, comm, rank: int, world_size: int, device, partition_device=None):
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.partition_device = torch.device(partition_device) if partition_device is not None else self.device
        #: non-persistent parameters whose full value exists or is on its way, oldest first
        self.live: "OrderedDict[int, torch.nn.Parameter]" = OrderedDict()
        self.live_numel = 0  # elements of the parameters in ``live``
        self.inflight_numel = 0  # elements of the non-persistent parameters still INFLIGHT
        #: called with the parameters whose partitions were rewritten from a full value
        self.update_listeners: List[Callable[[List[torch.nn.Parameter]], None]] = []
        #: ZeRO++: how forward / backward gathers move values (None: exact all-gathers; see zeropp)
        self.wire = None
        self._computing = False
        #: bumped whenever partitions change (a step, a load): hpZ's secondary shards go stale
        self.generation = 0
        #: released full buffers kept for the next gathers of the same size: on CPU a large fresh
        #: buffer is page-faulted in on every gather (measured: ~0.6 ms per MB, a third of a 50M
        #: forward pass), which a CUDA caching allocator avoids by itself. Kept buffers plus
        #: gathered parameters stay within ``keep_limit`` elements (the stage sets it to
        #: ``stage3_max_live_parameters`` on CPU; 0 keeps none).
        self.keep_limit = 0
        self.kept: Dict[tuple, List[torch.Tensor]] = {}
        self.kept_numel = 0

    @contextlib.contextmanager
    def computing(self):
        """Gathers started inside are for computing (forward / backward): ZeRO++ applies to them."""
        previous, self._computing = self._computing, True
        try:
            yield
        finally:
            self._computing = previous

    def partitions_changed(self) -> None:
        """Partitions were rewritten (optimizer step, checkpoint / state dict load, write-back)."""
        self.generation += 1

    # ------------------------------------------------------------------ conversion
    def partition(self, params: Iterable[torch.nn.Parameter], broadcast_from: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> List[torch.nn.Parameter]:
        """Turn full parameters into partitioned ones (this rank keeps its slice).

        ``broadcast_from``: first make every rank's values equal to that rank's (zero.Init, where
        each rank initialised its own copy).
        """
        todo = [p for p in unique(params) if not is_partitioned(p)]
        if broadcast_from is not None and self.world_size > 1:
            self._broadcast(todo, broadcast_from)
        for p in todo:
            full = p.data if dtype is None else p.data.to(dtype)
            p.ds_id = next(_ids)
            p.ds_shape = full.shape
            p.ds_numel = full.numel()
            p.ds_tensor = piece_of(full, self.rank, self.world_size).to(self.partition_device)
            p.ds_persist = False
            p._ds_holds = 0
            p._ds_handle = None
            p._ds_partitioner = self
            p._ds_quantized = False
            p.ds_status = ZeroParamStatus.AVAILABLE
            self._drop_full(p)
        return todo

    def adopt(self, p: torch.nn.Parameter, dtype: Optional[torch.dtype] = None) -> None:
        """Take over a parameter partitioned elsewhere (e.g. by zero.Init) into this partitioner."""
        if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
            owner = p._ds_partitioner
            owner.wait(p)
            owner._remove_live(p)
            self._drop_full(p)
        target_dtype = dtype or p.ds_tensor.dtype
        if p.ds_tensor.dtype != target_dtype or p.ds_tensor.device != self.partition_device:
            p.ds_tensor = p.ds_tensor.to(device=self.partition_device, dtype=target_dtype)
        p.data = torch.empty(0, dtype=target_dtype, device=self.device)
        p._ds_partitioner = self

    def _broadcast(self, params: List[torch.nn.Parameter], src: int) -> None:
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.data.reshape(-1) for p in group]).to(self.device)
            self.comm.broadcast(flat, src=src)
            offset = 0
            with torch.no_grad():
                for p in group:
                    p.data.copy_(flat[offset:offset + p.numel()].view_as(p.data))
                    offset += p.numel()

    # ------------------------------------------------------------------ gather / release
    def local_piece(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's partition on the compute device, ready to send (the offload seam)."""
        piece = p.ds_tensor
        return piece if piece.device == self.device else piece.to(self.device, non_blocking=True)

    def read_piece(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's partition of ``p`` (its values; an offload plugin may read it from storage)."""
        return p.ds_tensor

    def store_piece(self, p: torch.nn.Parameter, piece: torch.Tensor) -> None:
        """Overwrite this rank's partition of ``p`` with ``piece`` (the offload seam for writes)."""
        with torch.no_grad():
            p.ds_tensor.copy_(piece)
        self.partitions_changed()

    def allocate_flat(self, name: str, numel: int, dtype) -> Optional[torch.Tensor]:
        """A flat tensor to hold a param group's partitions (the stage moves them in), or None when
        partitions are kept one by one (an offload device that needs swap buffers)."""
        return torch.empty(int(numel), dtype=dtype, device=self.partition_device)

    def locations(self) -> List[str]:
        """Files holding partitions outside the process (an offload device's), for tools and tests."""
        return []

    def close(self) -> None:
        """Release what the partitioner holds outside the process (an offload device)."""

    def gather_async(self, params: Iterable[torch.nn.Parameter]) -> List[GatherHandle]:
        """Start all-gathers for the parameters that are NOT_AVAILABLE (one per dtype)."""
        return [GatherHandle(self, group) for group in self._claim_for_gather(params)]

    def _claim_for_gather(self, params: Iterable[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
        """The NOT_AVAILABLE parameters, grouped by dtype, counted as live / in flight."""
        todo = [p for p in unique(params) if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for p in todo:
            by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
            if not p.ds_persist:
                self._add_live(p)
                self.inflight_numel += p.ds_numel
        return list(by_dtype.values())

    def fetch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Make every parameter AVAILABLE with its exact value (gathering, or waiting for a gather in
        flight; a full value that came from a ZeRO++ quantized gather is gathered again)."""
        params = list(params)
        if self.wire is not None:
            for p in unique(params):
                if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                    self.wait(p)
                    if getattr(p, "_ds_quantized", False):
                        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
                        self._remove_live(p)
        for handle in self.gather_async(params):
            handle.wait()
        for p in params:
            self.wait(p)

    @staticmethod
    def wait(p: torch.nn.Parameter) -> None:
        if p.ds_status is ZeroParamStatus.INFLIGHT:
            p._ds_handle.wait()

    def release(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Drop the full values (not of persistent parameters, nor of ones held by a context)."""
        for p in params:
            if p.ds_persist or p._ds_holds > 0 or p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
                continue
            self.wait(p)
            self._remove_live(p)
            self._drop_full(p)

    def release_all(self) -> None:
        """Release every gathered non-persistent parameter that no context holds."""
        self.release(list(self.live.values()))

    def release_persistent(self, params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        """Drop the full values of persistent parameters too (no context holding them); returns
        those dropped, which stay persistent and must be fetched again before they are used."""
        dropped = []
        for p in params:
            if p.ds_persist and p._ds_holds == 0 and p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                self.wait(p)
                self._drop_full(p)
                dropped.append(p)
        return dropped

    def _add_live(self, p) -> None:
        if p.ds_id not in self.live:
            self.live[p.ds_id] = p
            self.live_numel += p.ds_numel

    def _remove_live(self, p) -> None:
        if self.live.pop(p.ds_id, None) is not None:
            self.live_numel -= p.ds_numel

    def _drop_full(self, p: torch.nn.Parameter) -> None:
        full, p._ds_full = getattr(p, "_ds_full", None), None
        p.data = torch.empty(0, dtype=p.ds_tensor.dtype, device=self.device)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        p._ds_quantized = False
        if full is not None and _SOLE_REFERENCES > 0 and \
                self.live_numel + self.kept_numel + full.numel() <= self.keep_limit:
            self.kept.setdefault((full.numel(), full.dtype), []).append(full)
            self.kept_numel += full.numel()

    def full_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for a gathered full value: a kept one of that size that nothing else views
        any more (checked now, not at release: a finished collective may still hold a view for a
        moment, and a view the user keeps holds the memory anyway), else a new one."""
        kept = self.kept.get((numel, dtype), [])
        for i in range(len(kept) - 1, -1, -1):
            if _sole_reference(kept[i]):
                self.kept_numel -= numel
                return kept.pop(i)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def kept_buffers(self) -> List[torch.Tensor]:
        return [t for ts in self.kept.values() for t in ts]

    # ------------------------------------------------------------------ persistence / updates
    def make_persistent(self, params: Iterable[torch.nn.Parameter]) -> None:
        params = list(params)
        for p in params:
            if p.ds_id in self.live and p.ds_status is ZeroParamStatus.INFLIGHT:
                self.inflight_numel -= p.ds_numel
            self._remove_live(p)
            p.ds_persist = True
        self.fetch(params)

    def refresh(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Re-gather parameters that stay whole (persistent or held) after their partitions changed."""
        params = [p for p in params if p.ds_status is ZeroParamStatus.AVAILABLE]
        for p in params:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            self._remove_live(p)
        self.fetch(params)

    def write_back(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Store this rank's slice of each (AVAILABLE) parameter's full value into its partition."""
        params = [p for p in unique(params) if p.ds_status is ZeroParamStatus.AVAILABLE]
        with torch.no_grad():
            for p in params:
                self.store_piece(p, piece_of(p.data, self.rank, self.world_size))
        self.partitions_changed()
        for listener in self.update_listeners:
            listener(params)

    def hold(self, params: Iterable[torch.nn.Parameter], delta: int) -> None:
        for p in params:
            p._ds_holds += delta
