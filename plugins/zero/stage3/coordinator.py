"""When stage 3 gathers and releases parameters.

Fetch units. Each module fetches its own (direct) parameters plus any registered as external to
it (:func:`dsplug.zero.register_external_parameter`); a module marked as a leaf
(:func:`dsplug.utils.set_z3_leaf_modules`) fetches its whole subtree at once, and so, with
``stage3_module_granularity_threshold`` > 0, does a module whose parameters-per-descendant ratio
is below it. Persistent parameters are never fetched (always whole).

Forward: a forward pre-hook gathers the unit; the forward post-hook releases it, unless another
running forward holds it or the parameter is used again within ``stage3_max_reuse_distance``
elements of fetching (known from the recorded trace, below), and wraps the module's outputs in
:class:`_PreBackward`, an identity autograd function whose backward re-gathers the unit just
before the module's own backward nodes run (they read the saved parameters). Backward: a
parameter is released as soon as its gradient has been accumulated, which autograd does only
after every node that uses it has run (the stage's gradient hook calls :meth:`param_done`).

Trace and prefetch. The first forward+backward pass records the order in which units are
fetched. Later passes compare against it; while they match, each fetch also starts all-gathers
for the next units in the trace, as long as fewer than ``stage3_prefetch_bucket_size``
elements are in flight. A pass that departs from the trace turns prefetching off and a new trace
is recorded on the next pass.

ZeRO++. The gathers started here (fetch and prefetch) run inside
:meth:`~.partitioned_param.ParamPartitioner.computing`, so with ZeRO++ on they send int8
block-quantized weights (qwZ) or stay inside the hpZ group (see :mod:`dsplug.plugins.zero.stage3.zeropp`).

Recompute in backward (activation checkpointing). A checkpointed forward runs again inside
backward, so the forward hooks fire there too: the pre-hook gathers as usual, but the post-hook
does not release a parameter that backward still needs -- one that will receive a gradient (it
is released when the gradient has been accumulated, as in any backward: autograd's
``AccumulateGrad`` shapes the gradient after the parameter, so the parameter must be whole then)
or one a ``_PreBackward`` fetched for a node that has not run yet. Non-reentrant checkpointing
(``torch.utils.checkpoint(use_reentrant=False)``, Hugging Face's default) starts the recompute
from whichever saved tensor backward unpacks first, often after the module's own
``_PreBackward`` fetch; releasing there left ``AccumulateGrad`` a 0-element parameter. Only
parameters without gradient that no pending backward node asked for are released after a
recompute (the recomputed graph keeps its own references to the values it saved).

Live limit. ``stage3_max_live_parameters`` bounds the elements of gathered non-persistent
parameters: prefetching stops short of it, and in forward a fetch that would exceed it first
releases parameters kept for reuse (oldest first). A single unit larger than the limit is still
gathered. In backward nothing is evicted (the parameters wait for their gradients).
"""
from __future__ import annotations

import enum
import logging
from typing import Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import external
from .leaf import z3_leaf_module
from .partitioned_param import ZeroParamStatus, is_partitioned, unique

logger = logging.getLogger("dsplug")


class TraceState(enum.Enum):
    RECORDING = 1
    COMPLETE = 2
    INVALID = 3  # this pass departed from the trace; record again from the next pass


class _SavedParam:
    """What autograd keeps of a saved view of a gathered parameter (see ParamCoordinator._pack)."""

    __slots__ = ("param", "shape", "stride", "offset")

    def __init__(self, param, shape, stride, offset):
        self.param, self.shape, self.stride, self.offset = param, shape, stride, offset


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward gathers the module's parameters."""

    @staticmethod
    def forward(ctx, coordinator, module, *tensors):
        ctx.coordinator = coordinator
        ctx.module = module
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.coordinator.pre_backward(ctx.module)
        return (None, None, *grads)


def _granularity(module: torch.nn.Module) -> float:
    numel = sum(p.ds_numel if is_partitioned(p) else p.numel() for p in module.parameters())
    descendants = sum(1 for _ in module.modules()) - 1
    return numel / (1 + descendants)


class ParamCoordinator:
    def __init__(self, partitioner, root: torch.nn.Module, *, prefetch_bucket_size: int,
                 max_live_parameters: int, max_reuse_distance: int, granularity_threshold: int = 0,
                 log_trace_warnings: bool = False):
        self.partitioner = partitioner
        self.root = root
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live = int(max_live_parameters)
        self.max_reuse = int(max_reuse_distance)
        self.log_trace_warnings = log_trace_warnings
        self.own_params: Dict[torch.nn.Module, List[torch.nn.Parameter]] = _fetch_units(root, granularity_threshold)
        self._unit_cache: Dict[torch.nn.Module, tuple] = {}
        self.state = TraceState.RECORDING
        self.trace: List[torch.nn.Module] = []
        self.trace_units: List[List[torch.nn.Parameter]] = []
        self.next_use: List[Dict[int, int]] = []
        self.position = 0  # next expected trace index
        self.cursor = 0  # first trace index not yet considered for prefetching
        self.module_holds: Dict[int, int] = {}  # ds_id -> running forwards using it
        self.active: List[Optional[int]] = []  # trace index of each running forward
        self.in_backward = False
        self.backward_fetched: set = set()  # ds_ids a _PreBackward fetched this pass (see _release_after_forward)
        self.passes = 0
        self._hooks = []
        #: the saved-tensor hooks entered for the root's forward (None outside it)
        self._saving = None
        #: persistent parameters to gather again when the next forward starts (see refetch_at_next_forward)
        self._refetch: List[torch.nn.Parameter] = []

    # ------------------------------------------------------------------ installation
    def install(self) -> None:
        for m in self.root.modules():
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward, always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def unit(self, module: torch.nn.Module) -> List[torch.nn.Parameter]:
        """The non-persistent partitioned parameters ``module`` gathers for its forward / backward."""
        cached = self._unit_cache.get(module)
        if cached is not None and cached[0] == external.generation:
            return cached[1]
        params = unique(self.own_params.get(module, []) + external.external_parameters(module))
        params = [p for p in params if is_partitioned(p) and not p.ds_persist]
        self._unit_cache[module] = (external.generation, params)
        return params

    # ------------------------------------------------------------------ hooks
    def refetch_at_next_forward(self, params: List[torch.nn.Parameter]) -> None:
        """Persistent parameters released between passes (``empty_partition_cache``): gathered
        again, whole, when the root module's next forward starts."""
        self._refetch.extend(params)

    def _pre_forward(self, module, inputs):
        if module is self.root and not self.in_backward:
            self.end_pass()  # a new pass starts; drops what a forward without backward left behind
            if self._refetch:
                params, self._refetch = self._refetch, []
                self.partitioner.fetch([p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE])
            if torch.is_grad_enabled() and self._saving is None:
                self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._saving.__enter__()
        params = self.unit(module)
        index = self._record(module) if params else None
        self.active.append(index)
        if params:
            for p in params:
                self.module_holds[p.ds_id] = self.module_holds.get(p.ds_id, 0) + 1
            self._fetch(params, index, evict=not self.in_backward)

    def _post_forward(self, module, inputs, output):
        index = self.active.pop() if self.active else None
        params = self.unit(module)
        if params:
            for p in params:
                self.module_holds[p.ds_id] = max(0, self.module_holds.get(p.ds_id, 0) - 1)
            self._release_after_forward(params, index)
            if torch.is_grad_enabled() and output is not None:
                output = self._wrap_outputs(module, output)
        if module is self.root and not self.in_backward and not torch.is_grad_enabled():
            self.end_pass()  # no backward follows a forward without grad
        if module is self.root and self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)
        return output

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, tensor):
        """Autograd saves a gathered parameter's value (or a view of it, e.g. the transposed weight of a
        linear) for backward: save a reference to the parameter instead, so that releasing the
        parameter after its module's forward frees its full value (else every layer's full weights
        stay alive until its backward: the whole model at the end of forward), and unpack the
        value gathered again for backward."""
        if tensor.device.type == "meta" or tensor.layout is not torch.strided:
            return tensor
        ptr = tensor.data_ptr()
        for p in self.partitioner.live.values():
            data = p.data
            start = data.data_ptr()
            if p.ds_persist or not data.numel() or data.dtype != tensor.dtype or not start <= ptr < start + \
                    data.numel() * data.element_size():
                continue
            return _SavedParam(p, tuple(tensor.shape), tuple(tensor.stride()),
                               tensor.storage_offset() - data.storage_offset())
        return tensor

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        p = saved.param
        if p.ds_status is not ZeroParamStatus.AVAILABLE:
            self._fetch([p], None, evict=False)
        data = p.data
        return data.as_strided(saved.shape, saved.stride, data.storage_offset() + saved.offset)

    def _wrap_outputs(self, module, output):
        leaves, spec = tree_flatten(output)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return output
        wrapped = _PreBackward.apply(self, module, *(leaves[i] for i in where))
        for i, tensor in zip(where, wrapped):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def pre_backward(self, module) -> None:
        params = self.unit(module)
        if params:
            self.backward_fetched.update(p.ds_id for p in params)
            self._fetch(params, self._record(module), evict=False)

    def param_done(self, p) -> None:
        """Backward will not read ``p`` again in this pass (its gradient has been accumulated)."""
        self.backward_fetched.discard(p.ds_id)
        if not p.ds_persist and not self.module_holds.get(p.ds_id):
            self._release([p])

    # ------------------------------------------------------------------ fetch / release
    def _fetch(self, params, index: Optional[int], evict: bool) -> None:
        missing = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if evict and missing:
            self._make_room(sum(p.ds_numel for p in missing), keep={p.ds_id for p in params})
        with self.partitioner.computing():  # ZeRO++ applies to these gathers (see zeropp)
            handles = self.partitioner.gather_async(missing)
            if index is not None:
                for_this = sum(p.ds_numel for p in params if p.ds_status is ZeroParamStatus.INFLIGHT)
                self._prefetch_after(index, self.partitioner.inflight_numel - for_this)
        for handle in handles:
            handle.wait()
        for p in params:
            self.partitioner.wait(p)

    def _release(self, params) -> None:
        self.partitioner.release(params)
        # a released parameter may be needed again by a trace step already passed over for prefetching
        self.cursor = min(self.cursor, self.position)

    def _make_room(self, needed: int, keep) -> None:
        excess = self.partitioner.live_numel + needed - self.max_live
        for p in list(self.partitioner.live.values()):
            if excess <= 0:
                return
            if (p.ds_id in keep or p.ds_status is not ZeroParamStatus.AVAILABLE or p._ds_holds
                    or self.module_holds.get(p.ds_id)):
                continue
            self._release([p])
            excess -= p.ds_numel

    def _prefetch_after(self, index: int, inflight_ahead: int) -> None:
        """Start gathers for the trace steps after ``index`` while fewer than
        ``stage3_prefetch_bucket_size`` elements are in flight ahead of use (and the live limit holds)."""
        if self.state is not TraceState.COMPLETE or self.prefetch_bucket_size <= 0:
            return
        budget = self.prefetch_bucket_size - inflight_ahead
        j = max(self.cursor, index + 1)
        picked, seen, total = [], set(), 0
        live = self.partitioner.live_numel
        while j < len(self.trace) and total < budget:
            todo = [p for p in self.trace_units[j]
                    if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_id not in seen]
            size = sum(p.ds_numel for p in todo)
            if todo and live + total + size > self.max_live:
                break
            picked += todo
            seen.update(p.ds_id for p in todo)
            total += size
            j += 1
        self.cursor = j
        if picked:
            self.partitioner.gather_async(picked)

    def _release_after_forward(self, params, index: Optional[int]) -> None:
        reuse = self.next_use[index] if index is not None and self.state is TraceState.COMPLETE else {}
        done = []
        for p in params:
            if self.module_holds.get(p.ds_id):
                continue
            if self.in_backward and (p.requires_grad or p.ds_id in self.backward_fetched):
                continue  # a recompute: backward still needs p (see the module docstring)
            distance = reuse.get(p.ds_id)
            if distance is not None and distance < self.max_reuse:
                continue
            done.append(p)
        if done:
            self._release(done)

    # ------------------------------------------------------------------ trace
    def _record(self, module) -> Optional[int]:
        if self.state is TraceState.RECORDING:
            self.trace.append(module)
            self.trace_units.append(list(self.unit(module)))
            return len(self.trace) - 1
        if self.state is TraceState.COMPLETE:
            if self.position < len(self.trace) and self.trace[self.position] is module:
                self.position += 1
                return self.position - 1
            if self.log_trace_warnings:
                expected = type(self.trace[self.position]).__name__ if self.position < len(self.trace) else "the end"
                logger.warning(f"ZeRO stage 3: pass {self.passes} fetched {type(module).__name__} at trace step "
                               f"{self.position}, the recorded trace has {expected}; prefetching is off until "
                               "a new trace is recorded")
            self.state = TraceState.INVALID
        return None

    def end_pass(self) -> None:
        """Between passes: release what is left, and settle the trace."""
        self.partitioner.release_all()
        if self.state is TraceState.RECORDING and self.trace:
            self.state = TraceState.COMPLETE
            self.next_use = _reuse_distances(self.trace_units)
        elif self.state is TraceState.INVALID:
            self.state = TraceState.RECORDING
            self.trace, self.trace_units, self.next_use = [], [], []
        if self.position or self.active or self.module_holds:
            self.passes += 1
        self.position = 0
        self.cursor = 0
        self.module_holds.clear()
        self.active.clear()
        self.backward_fetched.clear()


def _reuse_distances(units: List[List[torch.nn.Parameter]]) -> List[Dict[int, int]]:
    """For trace step i and each of its parameters: the elements fetched by the steps strictly
    between i and the parameter's next use (absent when it is not used again)."""
    cumulative = [0]
    for unit in units:
        cumulative.append(cumulative[-1] + sum(p.ds_numel for p in unit))
    distances: List[Dict[int, int]] = [dict() for _ in units]
    next_seen: Dict[int, int] = {}
    for i in range(len(units) - 1, -1, -1):
        for p in units[i]:
            j = next_seen.get(p.ds_id)
            if j is not None:
                distances[i][p.ds_id] = cumulative[j] - cumulative[i + 1]
        for p in units[i]:
            next_seen[p.ds_id] = i
    return distances


def _fetch_units(root: torch.nn.Module, granularity_threshold: int) -> Dict[torch.nn.Module, List[torch.nn.Parameter]]:
    units: Dict[torch.nn.Module, List[torch.nn.Parameter]] = {}

    def visit(module, covered: bool) -> None:
        if module in units:
            return
        if covered:
            units[module] = []
        elif z3_leaf_module(module) or (granularity_threshold > 0 and any(True for _ in module.children())
                                        and _granularity(module) < granularity_threshold):
            units[module] = list(module.parameters())
            covered = True
        else:
            units[module] = list(module.parameters(recurse=False))
        for child in module.children():
            visit(child, covered)

    visit(root, False)
    return units
