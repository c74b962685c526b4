"""ZeRO stage 3 partitions with offloaded master weights and optimizer states (ZeRO-Offload /
ZeRO-Infinity); the stage's seam is :class:`dsplug.plugins.zero.stage3.stage.InMemoryPartitions`.
Every byte lives in an offload device, reached only through the storage contract
(:class:`dsplug.contracts.OffloadDevice`).

Per optimizer param group, this rank's pieces of the group's parameters (in order) are split in
two: the *host* share — the longest prefix of pieces whose elements stay within
``offload_optimizer.ratio`` of the group's — and the *device* share, the rest. The device share
keeps its fp32 master on the accelerator and is stepped there by the optimizer the config or the
client gives; the host share is stepped on the CPU by DeepSpeed's CPU optimizer
(:func:`~dsplug.plugins.zero.partitioning.offload.build_host_optimizer`), its fp32 master and
optimizer state living in the ``offload_optimizer`` device:

* a byte-addressable device (``cpu``, ``mmap``, ...) — in stored tensors used in place (the
  master one flat tensor per group, the CPU optimizer's state placed beside it:
  :class:`~dsplug.plugins.zero.partitioning.offload.PlacedState`);
* a device that needs swap buffers (``nvme``) — ``sub_group_size`` partition elements per stored
  tensor (whole parameter pieces; a larger piece is a sub-group of its own). The step walks the
  sub-groups: read the fp32 master and each state into buffers of the ``buffer_count`` pool, step,
  write them back. ``pipeline_read`` starts reading the next sub-group before stepping the current
  one; ``pipeline_write`` lets the writes of a stepped sub-group run while the next is stepped.

Gradient partitions are reduced on the accelerator as without offloading; at the step the host
share is copied into a host fp32 buffer (unscaled and clipped there). The model-dtype partitions
follow the masters after the step: in the same pass by ``cpu_adam`` when they are 16-bit host
tensors (``step(fp16_param_groups=...)``), else by a copy; with an ``offload_param`` device that
needs swap buffers they are written to it (:mod:`.offload_params`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from dsplug.contracts.offload import BYTE_ADDRESSABLE, OffloadDevice, OffloadError, Stored, Work

from ..partitioning.offload import (FP32, HALF, PlacedState, SplitOptimizer, SwapBufferPool, build_host_optimizer,
                                    host_share, is_cpu_optimizer, sub_groups)
from .offload_grads import SwappedGradients
from .offload_params import SwappedParamPartitioner


class OffloadGroup:
    """One optimizer param group's partitions under offloading (the stage-3 group interface)."""

    def __init__(self, gi: int, params: List[torch.nn.Parameter], model_dtype, master_weights: bool, partitioner,
                 opt_device: Optional[OffloadDevice], ratio: float):
        self.params = params
        self.partitioner = partitioner
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        total = sum(self.sizes)
        self.host_count = host_share(self.sizes, ratio) if opt_device is not None else 0
        self.host_numel = sum(self.sizes[:self.host_count])
        in_place = opt_device is not None and BYTE_ADDRESSABLE in opt_device.capabilities
        #: the host share's master and state are swapped in per sub-group (set up by the store)
        self.swapped_host = opt_device is not None and not in_place
        compute = partitioner.device

        # model-dtype partitions: one flat buffer (the param device's when offloaded), unless the
        # partitioner keeps them one by one (a param device that needs swap buffers)
        self.flat: Optional[torch.Tensor] = partitioner.allocate_flat(f"group{gi}_params", total, model_dtype)
        if self.flat is not None:
            flat = self.flat
            for p, o, k in zip(params, self.offsets, self.sizes):
                flat[o:o + k].copy_(p.ds_tensor)
                p.ds_tensor = flat[o:o + k]

        # device share: fp32 master on the accelerator (the flat buffer itself when it is fp32 there)
        h = self.host_numel
        if self.flat is not None and self.flat.device == compute and self.flat.dtype == FP32 and not master_weights:
            self.dev_master, self.dev_alias = self.flat[h:], True
        else:
            self.dev_master = self._partitions(range(self.host_count, len(params)), compute)
            self.dev_alias = False

        # host share: fp32 master in the optimizer device, in place (byte-addressable) or swapped in
        # per sub-group (set up by the store); fp32 training on the host keeps it in the flat buffer
        self.host_master: Optional[torch.Tensor] = None
        self.host_alias = False
        self.stored: List[Stored] = []
        if in_place:
            if (self.flat is not None and self.flat.device.type == "cpu" and self.flat.dtype == FP32
                    and not master_weights and not opt_device.pin_memory):
                self.host_master, self.host_alias = self.flat[:h], True
            else:
                stored = opt_device.allocate(f"group{gi}_master", h, FP32)
                self.stored.append(stored)
                self.host_master = opt_device.tensor(stored)
                self.host_master.copy_(self._partitions(range(self.host_count), torch.device("cpu")))
        if self.swapped_host:
            host_views = [torch.empty(0, dtype=FP32) for _ in range(self.host_count)]  # filled while swapped in
        else:
            host_views = [self.host_master[o:o + k] for o, k in zip(self.offsets[:self.host_count],
                                                                    self.sizes[:self.host_count])]
        dev_views = [self.dev_master[o - h:o - h + k] for o, k in zip(self.offsets[self.host_count:],
                                                                       self.sizes[self.host_count:])]
        self.views: List[torch.Tensor] = host_views + dev_views
        # a swapped host share's gradients are swapped too (.offload_grads), never held here whole
        self.host_grad = opt_device.host_tensor(h, FP32).zero_() if h and not self.swapped_host else None
        self.grad: Optional[torch.Tensor] = None
        self.grad_views: List[Optional[torch.Tensor]] = []
        self.grad_dtype = FP32
        #: the host share's model-dtype partitions were written by the optimizer's step itself
        self.written_by_step = False

    # ------------------------------------------------------------------ values
    @property
    def numel(self) -> int:
        return sum(p.ds_numel for p in self.params)

    def piece_range(self, i: int) -> Tuple[int, int]:
        return self.offsets[i], self.offsets[i] + self.sizes[i]

    def partition_of(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s model-dtype partition (from the flat buffer or the partitioner)."""
        if self.flat is not None:
            a, b = self.piece_range(i)
            return self.flat[a:b]
        return self.partitioner.read_piece(self.params[i])

    def _partitions(self, indices, device) -> torch.Tensor:
        pieces = [self.partition_of(i).to(device=device, dtype=FP32) for i in indices]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=FP32, device=device)

    def write_partitions(self, indices, values=None) -> None:
        """Model-dtype partitions of pieces ``indices`` := their masters (or ``values``)."""
        indices = list(indices)
        values = values if values is not None else [self.views[i] for i in indices]
        if self.flat is not None:
            for i, v in zip(indices, values):
                a, b = self.piece_range(i)
                self.flat[a:b].copy_(v)
        elif indices:
            self.partitioner.store_pieces([(self.params[i], v) for i, v in zip(indices, values)])

    def update_partitions(self, host: bool) -> None:
        """After a step: device share (unless aliased), host share too when ``host``."""
        h, n = self.host_count, len(self.params)
        if not self.dev_alias and n > h:
            if self.flat is not None:
                self.flat[self.host_numel:].copy_(self.dev_master)
            else:
                self.write_partitions(range(h, n))
        if host and h and not self.host_alias and not self.written_by_step:
            if self.flat is not None and self.host_master is not None:
                self.flat[:self.host_numel].copy_(self.host_master)
            else:
                self.write_partitions(range(h))

    # ------------------------------------------------------------------ gradients
    def allocate_grads(self, dtype) -> None:
        """The gradient partitions: one flat buffer, or with a swapped host share only the device
        share's (the host share's views are None: its pieces go to the store's SwappedGradients)."""
        self.grad_dtype = dtype
        if self.swapped_host:
            h = self.host_numel
            rest = sum(self.sizes) - h
            self.grad = torch.zeros(rest, dtype=dtype, device=self.partitioner.device) if rest else None
            self.grad_views = [None] * self.host_count + [self.grad[o - h:o - h + k] for o, k in
                                                          zip(self.offsets[self.host_count:],
                                                              self.sizes[self.host_count:])]
            return
        self.grad = torch.zeros(sum(self.sizes), dtype=dtype, device=self.partitioner.device)
        self.grad_views = [self.grad[o:o + k] for o, k in zip(self.offsets, self.sizes)]

    def claim(self, i: int, dtype) -> Optional[torch.Tensor]:
        return None  # (the partitions are zeroed at zero_grad: pieces are accumulated)

    def accumulate(self, i: int, piece: torch.Tensor) -> bool:
        """Add a reduced gradient piece into parameter ``i``'s partition; False when that partition
        is in a swapped sub-group (the store's SwappedGradients takes the piece)."""
        view = self.grad_views[i]
        if view is None:
            return False
        view.add_(piece)
        return True

    def attach_grads(self) -> List[torch.Tensor]:
        if self.swapped_host:  # the host share's gradients are read per sub-group by the step
            if self.grad is None:
                return []
            rest = self.grad if self.grad.dtype == FP32 else self.grad.float()
            h = self.host_numel
            for view, o, k in zip(self.views[self.host_count:], self.offsets[self.host_count:],
                                  self.sizes[self.host_count:]):
                view.grad = rest[o - h:o - h + k]
            return [rest]
        flat = self.grad if self.grad.dtype == FP32 else self.grad.float()
        h, out = self.host_numel, []
        if self.host_grad is not None:
            self.host_grad.copy_(flat[:h])
            if not self.swapped_host:  # swapped: set per sub-group while it is swapped in
                for view, o, k in zip(self.views[:self.host_count], self.offsets, self.sizes):
                    view.grad = self.host_grad[o:o + k]
            out.append(self.host_grad)
        if h < flat.numel():
            rest = flat[h:]
            for view, o, k in zip(self.views[self.host_count:], self.offsets[self.host_count:],
                                  self.sizes[self.host_count:]):
                view.grad = rest[o - h:o - h + k]
            out.append(rest)
        return out

    def zero_grad(self) -> None:
        for view in self.views:
            view.grad = None
        if self.grad is not None:
            self.grad.zero_()

    # ------------------------------------------------------------------ checkpoint / load (views resident)
    def master_fp32(self) -> torch.Tensor:
        pieces = [v.detach().to(device="cpu", dtype=FP32) for v in self.views]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=FP32)

    def load_master(self, fp32: torch.Tensor, from_fp32: bool) -> None:
        if not from_fp32:
            self.master_from_partitions()
            return
        for i, view in enumerate(self.views):
            a, b = self.piece_range(i)
            view.copy_(fp32[a:b])
        self.written_by_step = False
        self.update_partitions(host=True)

    def set_master_piece(self, i: int, piece: torch.Tensor) -> None:
        self.views[i].copy_(piece)

    def master_from_partitions(self) -> None:
        for i, view in enumerate(self.views):
            aliased = self.dev_alias if i >= self.host_count else self.host_alias
            if not aliased:
                view.copy_(self.partition_of(i))

    def memory_tensors(self) -> Dict[str, List[torch.Tensor]]:
        optim = [t for t, aliased in ((self.host_master, self.host_alias), (self.dev_master, self.dev_alias))
                 if t is not None and not aliased]
        return {"optimizer_states": optim}


class _Unit:
    """One swapped sub-group: pieces ``indices`` of group ``gi``, ``numel`` elements, its stored tensors."""

    def __init__(self, gi: int, si: int, indices: List[int], group: OffloadGroup):
        self.gi, self.si, self.indices = gi, si, indices
        self.ranges = [(group.offsets[i] - group.offsets[indices[0]],
                        group.offsets[i] - group.offsets[indices[0]] + group.sizes[i]) for i in indices]
        self.numel = sum(group.sizes[i] for i in indices)
        self.start = group.offsets[indices[0]]  # in the group's partition (host share starts at 0)

    def name(self, key: str) -> str:
        return f"group{self.gi}_sub{self.si}_{key}"


class OffloadedPartitions:
    """The stage-3 partition store for ``offload_param`` / ``offload_optimizer`` (see the module doc).

    ``opt_device``: the ``offload_optimizer`` device (None: the optimizer stays on the accelerator,
    only parameters are offloaded, by ``partitioner``)."""

    def __init__(self, param_groups: List[dict], model_dtype, master_weights: bool, partitioner, zero_config,
                 context, opt_device: Optional[OffloadDevice]):
        self.context = context
        self.partitioner = partitioner
        self.zero_config = zero_config
        self.opt_device = opt_device
        self.opt_config = opt_device.config if opt_device is not None else None
        #: the host share's master and state are used in place (a byte-addressable device)
        self.in_place = opt_device is not None and BYTE_ADDRESSABLE in opt_device.capabilities
        #: they are swapped in per sub-group (a device that needs swap buffers)
        self.swapped = opt_device is not None and not self.in_place
        ratio = float(self.opt_config.ratio) if self.opt_config is not None else 0.0
        with torch.no_grad():
            self.groups = [OffloadGroup(gi, list(g["params"]), model_dtype, master_weights, partitioner, opt_device,
                                        ratio) for gi, g in enumerate(param_groups)]
            if isinstance(partitioner, SwappedParamPartitioner):
                names = {}
                if context.model is not None:
                    names = {p.ds_id: n for n, p in context.model.named_parameters() if hasattr(p, "ds_id")}
                partitioner.swap_out(names)
        self.host_opt = None
        self.dev_opt = None
        self.optimizer = None
        self.fp16_outputs = None
        #: the CPU optimizer's state in the (byte-addressable) optimizer device
        self.placed: Optional[PlacedState] = None
        # swapped optimizer state (set up by build_optimizer)
        self.units: List[_Unit] = []
        self.stored: Dict[Tuple[int, int, str], Stored] = {}  # (group, sub-group, "master" | state) -> stored
        self.pool: Optional[SwapBufferPool] = None
        self.keys: Optional[List[str]] = None  # element-wise optimizer state names (None: not known yet)
        self.key_dtypes: Dict[str, torch.dtype] = {}
        self.on_disk: Dict[Tuple[int, int], List[str]] = {}  # unit -> state names stored
        #: (write stream, buffers, works) of writes in flight
        self._writing: List[Tuple[int, List[torch.Tensor], List[Work]]] = []
        self._materialized = False
        self.steps = 0
        #: sub-groups whose read started before the previous sub-group's step (pipeline_read), and
        #: steps that ran while the previous sub-group's writes were in flight (pipeline_write)
        self.reads_ahead = 0
        self.steps_during_writes = 0
        #: the swapped sub-groups' gradients (None: none swapped)
        self.grads: Optional[SwappedGradients] = None

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(self, param_groups: List[dict], build_optimizer):
        host_groups, host_index, dev_groups, dev_index = [], [], [], []
        for g, grp in zip(param_groups, self.groups):
            c = grp.host_count
            host_index.append(len(host_groups) if c else None)
            if c:
                host_groups.append({**g, "params": grp.views[:c]})
            dev_index.append(len(dev_groups) if c < len(grp.params) else None)
            if c < len(grp.params):
                dev_groups.append({**g, "params": grp.views[c:]})
        where = (f"zero_optimization.offload_optimizer.device={self.opt_device.name!r}" if self.opt_device is not None
                 else "zero_optimization.offload_optimizer")
        host = build_host_optimizer(host_groups, build_optimizer, self.context, where) if host_groups else None
        device = build_optimizer(dev_groups) if dev_groups else None
        if host is not None and device is host:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {self.opt_config.ratio}: the step is split "
                             "between the CPU and the accelerator, which needs two optimizers, but the client "
                             "optimizer is one object. Pass a callable that builds the optimizer from param groups, "
                             "or an 'optimizer' config section, or set ratio to 1")
        if (host_groups and host is None) or (dev_groups and device is None):
            return None  # no optimizer (inference)
        self.host_opt, self.dev_opt = host, device
        if host is not None and device is not None:
            self.optimizer = SplitOptimizer([{"params": grp.views} for grp in self.groups], host, device,
                                            host_index, dev_index)
        else:
            self.optimizer = host or device
        if host is not None:
            self.fp16_outputs = self._fp16_outputs()
            if self.swapped:
                self._setup_swapped()
            elif is_cpu_optimizer(host):
                with torch.no_grad():
                    self.placed = PlacedState(self.opt_device, host)
        return self.optimizer

    def _fp16_outputs(self):
        """``fp16_param_groups`` for cpu_adam when the host share's partitions are 16-bit host tensors."""
        host_groups = [grp for grp in self.groups if grp.host_count]
        if not is_cpu_optimizer(self.host_opt):
            return None
        if not all(grp.flat is not None and grp.flat.device.type == "cpu" and grp.flat.dtype in HALF
                   for grp in host_groups):
            return None
        return [[grp.flat[a:b] for a, b in (grp.piece_range(i) for i in range(grp.host_count))]
                for grp in host_groups]

    def state_loaded(self) -> None:
        """The optimizer's state was replaced (a checkpoint load): keep it in the device."""
        if self.placed is not None:
            self.placed.rehome()

    # ------------------------------------------------------------------ step
    def step(self, optimizer) -> None:
        if optimizer is None:
            return
        if isinstance(optimizer, SplitOptimizer):
            optimizer.sync_hyper()
        with torch.no_grad():
            if self.dev_opt is not None:
                self.dev_opt.step()
            if self.host_opt is not None:
                if self.swapped:
                    self._step_swapped()
                else:
                    for grp in self.groups:
                        for stored in grp.stored:
                            self.opt_device.prefetch(stored)
                    kwargs = {"fp16_param_groups": self.fp16_outputs} if self.fp16_outputs is not None else {}
                    self.host_opt.step(**kwargs)
                    for grp in self.groups:
                        grp.written_by_step = self.fp16_outputs is not None
            for grp in self.groups:
                grp.update_partitions(host=self.in_place)
        self.steps += 1

    # ------------------------------------------------------------------ swapped: setup
    def _setup_swapped(self) -> None:
        config = self.opt_config
        sub = int(self.zero_config.sub_group_size)
        for gi, grp in enumerate(self.groups):
            for si, indices in enumerate(sub_groups(grp.sizes, 0, grp.host_count, sub)):
                self.units.append(_Unit(gi, si, indices, grp))
        if not self.units:
            return
        if is_cpu_optimizer(self.host_opt):
            self.keys = list(self.host_opt.STATE_KEYS)
            for key in self.keys:
                self.key_dtypes[key] = FP32 if self.host_opt.moment_dtype is None else self.host_opt.moment_dtype
        known = len(self.keys) if self.keys is not None else 2  # an unknown optimizer: assume Adam's two states
        self._check_buffer_count(known if self.keys is not None else 0)
        largest = max(u.numel for u in self.units)
        elements = sum(u.numel for u in self.units)
        state_bytes = sum(torch.empty(0, dtype=d).element_size() for d in self.key_dtypes.values()) \
            if self.keys is not None else 4 * known
        # fp32 master + fp32 gradient + state, refused here when there is no room
        self.opt_device.reserve(elements * 8 + elements * state_bytes)
        self.grads = SwappedGradients(self, {(gi, i): p.requires_grad for gi, grp in enumerate(self.groups)
                                             for i, p in enumerate(grp.params)})
        self.pool = SwapBufferPool(self.opt_device, int(config.buffer_count), largest * 4, torch.uint8)
        init_states = self.keys is not None and not config.fast_init
        with torch.no_grad():
            for u in self.units:
                grp = self.groups[u.gi]
                buffer = self.pool.take()
                master = buffer[:u.numel * 4].view(FP32)
                for i, (a, b) in zip(u.indices, u.ranges):
                    master[a:b].copy_(grp.partition_of(i))
                self.opt_device.write(self._stored(u, "master"), master).wait()
                if init_states:
                    for key in self.keys:
                        zeros = buffer[:u.numel * _size(self.key_dtypes[key])].view(self.key_dtypes[key]).zero_()
                        self.opt_device.write(self._stored(u, key), zeros).wait()
                    self.on_disk[(u.gi, u.si)] = list(self.keys)
                    for i in u.indices:
                        self.host_opt.state[grp.views[i]] = {"step": 0}
                self.pool.give(buffer)

    def _stored(self, u: _Unit, key: str) -> Stored:
        """The stored tensor of unit ``u``'s ``key`` ("master", "grad" or a state), allocated on first use."""
        found = self.stored.get((u.gi, u.si, key))
        if found is None:
            dtype = FP32 if key in ("master", "grad") else self.key_dtypes[key]
            found = self.stored[(u.gi, u.si, key)] = self.opt_device.allocate(u.name(key), u.numel, dtype)
        return found

    def _check_buffer_count(self, states: int) -> None:
        need = 2 + states
        count = int(self.opt_config.buffer_count)
        if count < need:
            names = ", ".join(self.keys or []) or "its state"
            raise OffloadError(f"zero_optimization.offload_optimizer.buffer_count = {count} is too small: each "
                               f"sub-group swaps its fp32 master, its fp32 gradient and {states} optimizer state(s) "
                               f"({names}) through "
                               f"the buffer pool, so at least {need} buffers are needed ({2 * need} to overlap reading "
                               "the next sub-group with the step)")

    # ------------------------------------------------------------------ swapped: the step
    def _needs(self, u: _Unit) -> int:
        return 2 + len(self.on_disk.get((u.gi, u.si), []))  # master, gradient, the state stored so far

    def _take(self, n: int, latest: Optional[int] = None) -> Optional[List[torch.Tensor]]:
        """``n`` buffers from the pool, completing writes in flight as needed: those of other write
        streams first, those of stream ``latest`` (the last stepped sub-group's) only if still short."""
        for stream in sorted({s for s, _, _ in self._writing}, key=lambda s: s == latest):
            if self.pool.free >= n:
                break
            self._finish_writes(stream)
        if self.pool.free < n:
            return None
        return [self.pool.take() for _ in range(n)]

    def _read(self, u: _Unit, buffers: List[torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], List[Work]]:
        """Start reading unit ``u`` into ``buffers``: ``({"master" | state: tensor}, works)``."""
        out = {"master": buffers[0][:u.numel * 4].view(FP32), "grad": buffers[1][:u.numel * 4].view(FP32)}
        works = [self.opt_device.read(self._stored(u, "master"), out["master"])]
        grad_read = self.grads.read(u, out["grad"])
        if grad_read is not None:
            works.append(grad_read)
        for key, buf in zip(self.on_disk.get((u.gi, u.si), []), buffers[2:]):
            dtype = self.key_dtypes[key]
            out[key] = buf[:u.numel * _size(dtype)].view(dtype)
            works.append(self.opt_device.read(self._stored(u, key), out[key]))
        return out, works

    def _attach(self, u: _Unit, tensors: Dict[str, torch.Tensor], grads: bool) -> None:
        grp = self.groups[u.gi]
        state = self.host_opt.state
        for i, (a, b) in zip(u.indices, u.ranges):
            view = grp.views[i]
            view.data = tensors["master"][a:b]
            entry = state[view]
            for key, t in tensors.items():
                if key not in ("master", "grad"):
                    entry[key] = t[a:b]
            if grads:
                view.grad = tensors["grad"][a:b]

    def _detach(self, u: _Unit) -> None:
        grp = self.groups[u.gi]
        for i in u.indices:
            view = grp.views[i]
            view.grad = None
            view.data = torch.empty(0, dtype=FP32)
            entry = self.host_opt.state.get(view)
            if entry:
                for key in [k for k, v in entry.items() if _elementwise(v)]:
                    del entry[key]

    def _learn_keys(self, u: _Unit) -> None:
        """After a unit's first step with an optimizer whose state was unknown: its element-wise state."""
        grp = self.groups[u.gi]
        entry = self.host_opt.state.get(grp.views[u.indices[0]], {})
        found = [k for k, v in entry.items() if _elementwise(v)]
        if self.keys is None:
            self.keys = found
            for key in found:
                self.key_dtypes[key] = entry[key].dtype
            self._check_buffer_count(len(found))
            elements = sum(u.numel for u in self.units)
            self.opt_device.reserve(elements * sum(_size(d) for d in self.key_dtypes.values()))

    def _write_unit(self, u: _Unit, tensors: Dict[str, torch.Tensor], buffers: List[torch.Tensor],
                    stream: int = 0) -> None:
        """Start writing a stepped unit on write stream ``stream``; its buffers are released when
        those writes are waited for."""
        grp = self.groups[u.gi]
        works = [self.opt_device.write(self._stored(u, "master"), tensors["master"], stream)]
        extra = []
        for key in self.keys or []:
            if key in tensors:
                works.append(self.opt_device.write(self._stored(u, key), tensors[key], stream))
                continue
            # state the optimizer created in this step (first step): gather it into a buffer
            got = self._take(1, latest=stream) or [None]
            if got[0] is None:
                raise OffloadError("no swap buffer free to write new optimizer state")
            dtype = self.key_dtypes[key]
            flat = got[0][:u.numel * _size(dtype)].view(dtype)
            for i, (a, b) in zip(u.indices, u.ranges):
                flat[a:b].copy_(self.host_opt.state[grp.views[i]][key])
            works.append(self.opt_device.write(self._stored(u, key), flat, stream))
            extra.append(got[0])
        self.on_disk[(u.gi, u.si)] = list(self.keys or [])
        self._writing.append((stream, buffers + extra, works))

    def _finish_writes(self, stream: Optional[int] = None) -> None:
        """Wait for the writes of ``stream`` (all when None) and give their buffers back."""
        done = [w for w in self._writing if stream is None or w[0] == stream]
        self._writing = [w for w in self._writing if not (stream is None or w[0] == stream)]
        for _, _, works in done:
            for work in works:
                work.wait()
        for _, buffers, _ in done:
            for b in buffers:
                self.pool.give(b)

    def _step_swapped(self) -> None:
        """Step the swapped sub-groups in turn. Sub-group j is written on write stream j % 2, so the
        writes of j - 1 can run during the step of j while those of j - 2 are completed to free
        buffers; with ``pipeline_read`` the read of j + 1 is started before j is stepped (it takes
        precedence over overlapping writes when the pool is short)."""
        config = self.opt_config
        units = self.units
        ahead: Optional[Tuple[_Unit, List[torch.Tensor], Dict[str, torch.Tensor], List[Work]]] = None
        for j, u in enumerate(units):
            latest = (j - 1) % 2
            if ahead is not None and ahead[0] is u:
                _, buffers, tensors, reads = ahead
            else:
                buffers = self._take(self._needs(u), latest)
                if buffers is None:
                    raise OffloadError(f"zero_optimization.offload_optimizer.buffer_count = {config.buffer_count}: "
                                       f"not enough free swap buffers for a sub-group ({self._needs(u)} needed)")
                tensors, reads = self._read(u, buffers)
            for work in reads:
                work.wait()
            self.grads.finish_read(tensors["grad"])
            ahead = None
            if config.pipeline_read and j + 1 < len(units):
                following = units[j + 1]
                spare = self._take(self._needs(following), latest)
                if spare is not None:
                    ahead = (following, spare, *self._read(following, spare))
                    self.reads_ahead += 1
            self.steps_during_writes += bool(self._writing)
            self._attach(u, tensors, grads=True)
            self._step_unit(u)
            if self.keys is None or any(k not in tensors for k in self.keys):
                self._learn_keys(u)
            self.pool.give(buffers[1])  # the gradient is consumed: its buffer is free before the writes
            self._write_unit(u, tensors, buffers[:1] + buffers[2:], stream=j % 2)
            self._detach(u)
            if not config.pipeline_write:
                self._finish_writes()
        self._finish_writes()

    def _step_unit(self, u: _Unit) -> None:
        grp = self.groups[u.gi]
        if self.fp16_outputs is not None:
            self.host_opt.step(fp16_param_groups=self.fp16_outputs)
            grp.written_by_step = True
        else:
            self.host_opt.step()
            grp.write_partitions(u.indices)

    # ------------------------------------------------------------------ swapped: whole-state access
    @contextlib.contextmanager
    def materialized(self, write: bool = False):
        """Every host view and its optimizer state resident (fresh tensors) for the duration;
        ``write``: written back to the device afterwards."""
        if not self.swapped or not self.units or self._materialized:
            yield
            return
        self._materialized = True
        try:
            with torch.no_grad():
                for u in self.units:
                    tensors = {"master": torch.empty(u.numel, dtype=FP32)}
                    works = [self.opt_device.read(self._stored(u, "master"), tensors["master"])]
                    for key in self.on_disk.get((u.gi, u.si), []):
                        tensors[key] = torch.empty(u.numel, dtype=self.key_dtypes[key])
                        works.append(self.opt_device.read(self._stored(u, key), tensors[key]))
                    for work in works:
                        work.wait()
                    self._attach(u, tensors, grads=False)
            yield
            if write:
                with torch.no_grad():
                    self._write_all()
        finally:
            for u in self.units:
                self._detach(u)
            self._materialized = False

    def _write_all(self) -> None:
        state = self.host_opt.state
        for u in self.units:
            grp = self.groups[u.gi]
            views = [grp.views[i] for i in u.indices]
            works = [self.opt_device.write(self._stored(u, "master"),
                                           torch.cat([v.detach().reshape(-1) for v in views]).to(FP32))]
            entry = state.get(views[0], {})
            keys = [k for k, v in entry.items() if _elementwise(v)]
            for key in keys:
                self.key_dtypes.setdefault(key, entry[key].dtype)
                values = [state[v][key].reshape(-1).to(self.key_dtypes[key]) for v in views]
                works.append(self.opt_device.write(self._stored(u, key), torch.cat(values)))
            if keys:
                self.keys = self.keys or keys
                self.on_disk[(u.gi, u.si)] = keys
            for work in works:
                work.wait()

    # ------------------------------------------------------------------ accounting / lifecycle
    def memory(self, optimizer, params) -> Dict[str, List[torch.Tensor]]:
        resident = getattr(self.partitioner, "resident_partitions", None)
        parameters = resident() if resident is not None else [p.ds_tensor for p in params]
        optim = [t for grp in self.groups for t in grp.memory_tensors()["optimizer_states"]]
        if optimizer is not None:
            optim += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel()]
        return {"parameters": parameters, "optimizer_states": optim}

    def swap_files(self) -> List[str]:
        """Paths of the files that hold this rank's offloaded state now (optimizer, then
        parameters), for tests and tools; empty for devices that keep everything in memory."""
        import os

        out = []
        if self.opt_device is not None:
            stored = [s for grp in self.groups for s in grp.stored] + list(self.stored.values())
            if self.placed is not None:
                stored += self.placed.stored
            found = [self.opt_device.location(s) for s in stored]
            out += sorted(f for f in found if f and os.path.exists(f))
        return out + [f for f in self.partitioner.locations() if os.path.exists(f)]

    def close(self) -> None:
        """Finish pending I/O and release the devices (swap files, mappings, memory)."""
        try:
            if self.pool is not None:
                self._finish_writes()
        finally:
            try:
                if self.opt_device is not None:
                    self.opt_device.close()
            finally:
                self.partitioner.close()


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _elementwise(value) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1
