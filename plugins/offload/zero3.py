"""ZeRO stage 3 partitions with offloaded master weights and optimizer states (ZeRO-Offload /
ZeRO-Infinity); the stage's seam is :class:`dsplug.plugins.zero.stage3.stage.InMemoryPartitions`.

Per optimizer param group, this rank's pieces of the group's parameters (in order) are split in
two: the *host* share — the longest prefix of pieces whose elements stay within
``offload_optimizer.ratio`` of the group's — and the *device* share, the rest. The device share
keeps its fp32 master on the accelerator and is stepped there by the optimizer the config or the
client gives; the host share is stepped on the CPU by DeepSpeed's CPU optimizer
(:mod:`.host_optimizer`), its fp32 master and optimizer state living

* ``device: cpu`` — in host memory (page-locked with ``pin_memory`` where an accelerator exists);
* ``device: nvme`` — in swap files, ``sub_group_size`` partition elements per file (whole
  parameter pieces; a larger piece is a sub-group of its own). The step walks the sub-groups:
  read the fp32 master and each state into buffers of the ``buffer_count`` pool, step, write them
  back. ``pipeline_read`` starts reading the next sub-group before stepping the current one;
  ``pipeline_write`` lets the writes of a stepped sub-group run while the next is stepped.

Gradient partitions are reduced on the accelerator as without offloading; at the step the host
share is copied into a host fp32 buffer (unscaled and clipped there). The model-dtype partitions
follow the masters after the step: in the same pass by ``cpu_adam`` when they are 16-bit host
tensors (``step(fp16_param_groups=...)``), else by a copy; with ``offload_param.device: nvme``
they are written to the parameter swap files (:mod:`.params`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from .host_optimizer import SplitOptimizer, build_host_optimizer, is_cpu_optimizer
from .params import HostParamPartitioner, NvmeParamPartitioner
from .swap import BufferPool, SwapDir, SwapError, SwapFiles

FP32 = torch.float32
HALF = (torch.float16, torch.bfloat16)


def host_share(sizes: List[int], ratio: float) -> int:
    """How many leading pieces go to the host: the longest prefix within ``ratio`` of the elements."""
    total = sum(sizes)
    if ratio >= 1.0:
        return len(sizes)
    limit, used = ratio * total, 0
    for i, k in enumerate(sizes):
        if used + k > limit:
            return i
        used += k
    return len(sizes)


def sub_groups(sizes: List[int], first: int, last: int, sub_group_size: int) -> List[List[int]]:
    """Pieces ``first..last-1`` cut into runs of about ``sub_group_size`` elements (whole pieces)."""
    out, run, used = [], [], 0
    for i in range(first, last):
        if run and used + sizes[i] > sub_group_size:
            out.append(run)
            run, used = [], 0
        run.append(i)
        used += sizes[i]
    if run:
        out.append(run)
    return out


class HostMemory:
    """Host tensors for the offloaded share: page-locked through the accelerator when ``pin_memory``
    is set and there is an accelerator (on a CPU-only machine there is nothing to pin for)."""

    def __init__(self, accelerator, pin_memory: bool):
        self.accelerator = accelerator
        self.pin = bool(pin_memory) and accelerator is not None and accelerator.name != "cpu"

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.pin_memory(tensor) if self.pin else tensor


class OffloadGroup:
    """One optimizer param group's partitions under offloading (the stage-3 group interface)."""

    def __init__(self, params: List[torch.nn.Parameter], model_dtype, master_weights: bool, partitioner,
                 host_kind: Optional[str], ratio: float, host_memory: "HostMemory"):
        self.params = params
        self.partitioner = partitioner
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        total = sum(self.sizes)
        self.host_count = host_share(self.sizes, ratio) if host_kind else 0
        self.host_numel = sum(self.sizes[:self.host_count])
        self.nvme_host = host_kind == "nvme"
        compute = partitioner.device

        # model-dtype partitions: one flat buffer, unless the partitioner keeps them in files
        self.flat: Optional[torch.Tensor] = None
        if not isinstance(partitioner, NvmeParamPartitioner):
            flat = torch.empty(total, dtype=model_dtype, device=partitioner.partition_device)
            if isinstance(partitioner, HostParamPartitioner):
                flat = partitioner.host_tensor(flat)
            for p, o, k in zip(params, self.offsets, self.sizes):
                flat[o:o + k].copy_(p.ds_tensor)
                p.ds_tensor = flat[o:o + k]
            self.flat = flat

        # device share: fp32 master on the accelerator (the flat buffer itself when it is fp32 there)
        h = self.host_numel
        if self.flat is not None and self.flat.device == compute and self.flat.dtype == FP32 and not master_weights:
            self.dev_master, self.dev_alias = self.flat[h:], True
        else:
            self.dev_master = self._partitions(range(self.host_count, len(params)), compute)
            self.dev_alias = False

        # host share: fp32 master in host memory (cpu) or in swap files (nvme, set up by the store)
        self.host_master: Optional[torch.Tensor] = None
        self.host_alias = False
        if host_kind == "cpu":
            if (self.flat is not None and self.flat.device.type == "cpu" and self.flat.dtype == FP32
                    and not master_weights and not host_memory.pin):
                self.host_master, self.host_alias = self.flat[:h], True
            else:
                self.host_master = host_memory(self._partitions(range(self.host_count), torch.device("cpu")))
        if self.nvme_host:
            host_views = [torch.empty(0, dtype=FP32) for _ in range(self.host_count)]  # filled while swapped in
        else:
            host_views = [self.host_master[o:o + k] for o, k in zip(self.offsets[:self.host_count],
                                                                    self.sizes[:self.host_count])]
        dev_views = [self.dev_master[o - h:o - h + k] for o, k in zip(self.offsets[self.host_count:],
                                                                       self.sizes[self.host_count:])]
        self.views: List[torch.Tensor] = host_views + dev_views
        self.host_grad = host_memory(torch.zeros(h, dtype=FP32)) if h else None
        self.grad: Optional[torch.Tensor] = None
        self.grad_views: List[torch.Tensor] = []
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
        self.grad = torch.zeros(sum(self.sizes), dtype=dtype, device=self.partitioner.device)
        self.grad_views = [self.grad[o:o + k] for o, k in zip(self.offsets, self.sizes)]

    def attach_grads(self) -> List[torch.Tensor]:
        flat = self.grad if self.grad.dtype == FP32 else self.grad.float()
        h, out = self.host_numel, []
        if self.host_grad is not None:
            self.host_grad.copy_(flat[:h])
            if not self.nvme_host:  # nvme: set per sub-group while it is swapped in
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
    """One nvme sub-group: pieces ``indices`` of group ``gi``, ``numel`` elements, its files."""

    def __init__(self, gi: int, si: int, indices: List[int], group: OffloadGroup):
        self.gi, self.si, self.indices = gi, si, indices
        self.ranges = [(group.offsets[i] - group.offsets[indices[0]],
                        group.offsets[i] - group.offsets[indices[0]] + group.sizes[i]) for i in indices]
        self.numel = sum(group.sizes[i] for i in indices)
        self.start = group.offsets[indices[0]]  # in the group's partition (host share starts at 0)

    def file(self, key: str) -> str:
        return f"group{self.gi}_sub{self.si}_{key}.swp"


class OffloadedPartitions:
    """The stage-3 partition store for ``offload_param`` / ``offload_optimizer`` (see the module doc)."""

    def __init__(self, param_groups: List[dict], model_dtype, master_weights: bool, partitioner, zero_config,
                 context, offload: Dict[str, object]):
        self.context = context
        self.partitioner = partitioner
        self.zero_config = zero_config
        self.opt_device = offload.get("offload_optimizer")
        self.host_kind = self.opt_device.name if self.opt_device is not None else None
        opt_config = self.opt_device.config if self.opt_device is not None else None
        self.opt_config = opt_config
        accelerator = context.accelerator
        self.accelerator = accelerator
        host_memory = HostMemory(accelerator, bool(opt_config is not None and opt_config.pin_memory))
        self.pin = host_memory.pin
        ratio = float(opt_config.ratio) if opt_config is not None else 0.0
        with torch.no_grad():
            self.groups = [OffloadGroup(list(g["params"]), model_dtype, master_weights, partitioner,
                                        self.host_kind, ratio, host_memory) for g in param_groups]
            if isinstance(partitioner, NvmeParamPartitioner):
                names = {}
                if context.model is not None:
                    names = {p.ds_id: n for n, p in context.model.named_parameters() if hasattr(p, "ds_id")}
                partitioner.swap_out(names)
        self.host_opt = None
        self.dev_opt = None
        self.optimizer = None
        self.fp16_outputs = None
        # nvme optimizer state (set up by build_optimizer)
        self.units: List[_Unit] = []
        self.dir: Optional[SwapDir] = None
        self.files: Optional[SwapFiles] = None
        self.pool: Optional[BufferPool] = None
        self.keys: Optional[List[str]] = None  # element-wise optimizer state names (None: not known yet)
        self.key_dtypes: Dict[str, torch.dtype] = {}
        self.on_disk: Dict[Tuple[int, int], List[str]] = {}  # unit -> state names with a file
        self._writing: List[Tuple[int, List[torch.Tensor]]] = []  # (write stream, buffers) of writes in flight
        self._materialized = False
        self.steps = 0
        #: sub-groups whose read started before the previous sub-group's step (pipeline_read), and
        #: steps that ran while the previous sub-group's writes were in flight (pipeline_write)
        self.reads_ahead = 0
        self.steps_during_writes = 0

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
        where = f"zero_optimization.offload_optimizer.device={self.host_kind!r}"
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
            if self.host_kind == "nvme":
                self._setup_nvme()
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
                if self.host_kind == "nvme":
                    self._step_nvme()
                else:
                    kwargs = {"fp16_param_groups": self.fp16_outputs} if self.fp16_outputs is not None else {}
                    self.host_opt.step(**kwargs)
                    for grp in self.groups:
                        grp.written_by_step = self.fp16_outputs is not None
            for grp in self.groups:
                grp.update_partitions(host=self.host_kind == "cpu")
        self.steps += 1

    # ------------------------------------------------------------------ nvme: setup
    def _setup_nvme(self) -> None:
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
        self.dir = SwapDir(config.nvme_path, "offload_optimizer", self.context.rank,
                           elements * 4 + elements * state_bytes)
        self.files = SwapFiles(self.dir, self._aio_config())
        self.pool = BufferPool(int(config.buffer_count), largest * 4, torch.uint8, self.accelerator, self.pin)
        init_states = self.keys is not None and not config.fast_init
        with torch.no_grad():
            for u in self.units:
                grp = self.groups[u.gi]
                buffer = self.pool.take()
                master = buffer[:u.numel * 4].view(FP32)
                for i, (a, b) in zip(u.indices, u.ranges):
                    master[a:b].copy_(grp.partition_of(i))
                self.files.write(master, u.file("master"))
                self.files.wait_writes()
                if init_states:
                    for key in self.keys:
                        zeros = buffer[:u.numel * _size(self.key_dtypes[key])].view(self.key_dtypes[key]).zero_()
                        self.files.write(zeros, u.file(key))
                        self.files.wait_writes()
                    self.on_disk[(u.gi, u.si)] = list(self.keys)
                    for i in u.indices:
                        self.host_opt.state[grp.views[i]] = {"step": 0}
                self.pool.give(buffer)

    def _aio_config(self):
        config = getattr(self.context, "config", None)
        return config.section("aio") if config is not None else None

    def _check_buffer_count(self, states: int) -> None:
        need = 1 + states
        count = int(self.opt_config.buffer_count)
        if count < need:
            names = ", ".join(self.keys or []) or "its state"
            raise SwapError(f"zero_optimization.offload_optimizer.buffer_count = {count} is too small: each sub-group "
                            f"swaps its fp32 master and {states} optimizer state(s) ({names}) through the buffer "
                            f"pool, so at least {need} buffers are needed ({2 * need} to overlap reading the next "
                            "sub-group with the step)")

    # ------------------------------------------------------------------ nvme: the step
    def _needs(self, u: _Unit) -> int:
        return 1 + len(self.on_disk.get((u.gi, u.si), []))

    def _take(self, n: int, latest: Optional[int] = None) -> Optional[List[torch.Tensor]]:
        """``n`` buffers from the pool, completing writes in flight as needed: those of other write
        streams first, those of stream ``latest`` (the last stepped sub-group's) only if still short."""
        for stream in sorted({s for s, _ in self._writing}, key=lambda s: s == latest):
            if self.pool.free >= n:
                break
            self._finish_writes(stream)
        if self.pool.free < n:
            return None
        return [self.pool.take() for _ in range(n)]

    def _read(self, u: _Unit, buffers: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Start reading unit ``u`` into ``buffers``; returns ``{"master" | state: tensor}``."""
        out = {"master": buffers[0][:u.numel * 4].view(FP32)}
        self.files.read(out["master"], u.file("master"))
        for key, buf in zip(self.on_disk.get((u.gi, u.si), []), buffers[1:]):
            dtype = self.key_dtypes[key]
            out[key] = buf[:u.numel * _size(dtype)].view(dtype)
            self.files.read(out[key], u.file(key))
        return out

    def _attach(self, u: _Unit, tensors: Dict[str, torch.Tensor], grads: bool) -> None:
        grp = self.groups[u.gi]
        state = self.host_opt.state
        for i, (a, b) in zip(u.indices, u.ranges):
            view = grp.views[i]
            view.data = tensors["master"][a:b]
            entry = state[view]
            for key, t in tensors.items():
                if key != "master":
                    entry[key] = t[a:b]
            if grads:
                o = grp.offsets[i]
                view.grad = grp.host_grad[o:o + (b - a)]

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
            self._check_space()

    def _check_space(self) -> None:
        from .swap import available_bytes

        elements = sum(u.numel for u in self.units)
        needed = elements * sum(_size(d) for d in self.key_dtypes.values())
        free = available_bytes(self.dir.path)
        if needed > free:
            raise SwapError(f"zero_optimization.offload_optimizer.nvme_path = {self.opt_config.nvme_path!r}: the "
                            f"optimizer's state ({', '.join(self.keys)}) needs {needed} more bytes of swap files but "
                            f"only {free} are available")

    def _write_unit(self, u: _Unit, tensors: Dict[str, torch.Tensor], buffers: List[torch.Tensor],
                    stream: int = 0) -> None:
        """Start writing a stepped unit on write stream ``stream``; its buffers are released when
        those writes are waited for."""
        grp = self.groups[u.gi]
        self.files.write(tensors["master"], u.file("master"), stream)
        extra = []
        for key in self.keys or []:
            if key in tensors:
                self.files.write(tensors[key], u.file(key), stream)
                continue
            # state the optimizer created in this step (first step): gather it into a buffer
            got = self._take(1, latest=stream) or [None]
            if got[0] is None:
                raise SwapError("no swap buffer free to write new optimizer state")
            dtype = self.key_dtypes[key]
            flat = got[0][:u.numel * _size(dtype)].view(dtype)
            for i, (a, b) in zip(u.indices, u.ranges):
                flat[a:b].copy_(self.host_opt.state[grp.views[i]][key])
            self.files.write(flat, u.file(key), stream)
            extra.append(got[0])
        self.on_disk[(u.gi, u.si)] = list(self.keys or [])
        self._writing.append((stream, buffers + extra))

    def _finish_writes(self, stream: Optional[int] = None) -> None:
        """Wait for the writes of ``stream`` (all when None) and give their buffers back."""
        self.files.wait_writes(stream)
        done = [w for w in self._writing if stream is None or w[0] == stream]
        self._writing = [w for w in self._writing if not (stream is None or w[0] == stream)]
        for _, buffers in done:
            for b in buffers:
                self.pool.give(b)

    def _step_nvme(self) -> None:
        """Step the swapped sub-groups in turn. Sub-group j is written on write stream j % 2, so the
        writes of j - 1 can run during the step of j while those of j - 2 are completed to free
        buffers; with ``pipeline_read`` the read of j + 1 is started before j is stepped (it takes
        precedence over overlapping writes when the pool is short)."""
        config = self.opt_config
        units = self.units
        ahead: Optional[Tuple[_Unit, List[torch.Tensor], Dict[str, torch.Tensor]]] = None
        for j, u in enumerate(units):
            latest = (j - 1) % 2
            if ahead is not None and ahead[0] is u:
                _, buffers, tensors = ahead
            else:
                buffers = self._take(self._needs(u), latest)
                if buffers is None:
                    raise SwapError(f"zero_optimization.offload_optimizer.buffer_count = {config.buffer_count}: "
                                    f"not enough free swap buffers for a sub-group ({self._needs(u)} needed)")
                tensors = self._read(u, buffers)
            self.files.wait_reads()
            ahead = None
            if config.pipeline_read and j + 1 < len(units):
                following = units[j + 1]
                spare = self._take(self._needs(following), latest)
                if spare is not None:
                    ahead = (following, spare, self._read(following, spare))
                    self.reads_ahead += 1
            self.steps_during_writes += bool(self._writing)
            self._attach(u, tensors, grads=True)
            self._step_unit(u)
            if self.keys is None or any(k not in tensors for k in self.keys):
                self._learn_keys(u)
            self._write_unit(u, tensors, buffers, stream=j % 2)
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

    # ------------------------------------------------------------------ nvme: whole-state access
    @contextlib.contextmanager
    def materialized(self, write: bool = False):
        """Every host view and its optimizer state resident (fresh tensors) for the duration;
        ``write``: written back to the swap files afterwards."""
        if self.host_kind != "nvme" or not self.units or self._materialized:
            yield
            return
        self._materialized = True
        try:
            with torch.no_grad():
                for u in self.units:
                    tensors = {"master": torch.empty(u.numel, dtype=FP32)}
                    self.files.read(tensors["master"], u.file("master"))
                    for key in self.on_disk.get((u.gi, u.si), []):
                        tensors[key] = torch.empty(u.numel, dtype=self.key_dtypes[key])
                        self.files.read(tensors[key], u.file(key))
                    self.files.wait_reads()
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
            self.files.write(torch.cat([v.detach().reshape(-1) for v in views]).to(FP32), u.file("master"))
            entry = state.get(views[0], {})
            keys = [k for k, v in entry.items() if _elementwise(v)]
            for key in keys:
                self.key_dtypes.setdefault(key, entry[key].dtype)
                values = [state[v][key].reshape(-1).to(self.key_dtypes[key]) for v in views]
                self.files.write(torch.cat(values), u.file(key))
            if keys:
                self.keys = self.keys or keys
                self.on_disk[(u.gi, u.si)] = keys
            self.files.wait_writes()

    # ------------------------------------------------------------------ accounting / lifecycle
    def memory(self, optimizer, params) -> Dict[str, List[torch.Tensor]]:
        if isinstance(self.partitioner, NvmeParamPartitioner):
            parameters = self.partitioner.resident_partitions()
        else:
            parameters = [p.ds_tensor for p in params]
        optim = [t for grp in self.groups for t in grp.memory_tensors()["optimizer_states"]]
        if optimizer is not None:
            optim += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel()]
        return {"parameters": parameters, "optimizer_states": optim}

    def swap_files(self) -> List[str]:
        """Paths of this rank's swap files now (optimizer and parameter), for tests and tools."""
        import os

        out = []
        for swap_dir in (self.dir, getattr(self.partitioner, "dir", None)):
            if swap_dir is not None and not swap_dir.closed and os.path.isdir(swap_dir.path):
                out += [os.path.join(swap_dir.path, f) for f in swap_dir.swap_file_names()]
        return out

    def close(self) -> None:
        """Finish pending I/O and delete this process's swap directories."""
        try:
            if self.files is not None:
                self._finish_writes()
                self.files.close()
        finally:
            if self.dir is not None:
                self.dir.close()
            close = getattr(self.partitioner, "close", None)
            if close is not None:
                close()


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _elementwise(value) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1
