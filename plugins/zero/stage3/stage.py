"""ZeRO stage 3: parameters, gradients and optimizer states are all partitioned.

Each rank holds, for every parameter, only its slice (``per_param`` layout, see
:mod:`.partitioned_param`): the 16-bit (or fp32) partition the model computes with,
the gradient partition, and the fp32 master partition with the optimizer state. Per optimizer
param group these live in flat buffers; each parameter's pieces are views into them, and the
optimizer steps the views (so element-wise optimizers behave exactly as on full tensors).

Forward / backward: :class:`~.coordinator.ParamCoordinator` gathers each module's parameters
just before it runs and releases them after. Gradients: a hook on every parameter takes its
full gradient as soon as autograd has accumulated it, hands it to the
:class:`~.reduce.GradientReducer` (reduce-scatter into the owners' partitions, every micro-step),
and lets the coordinator release the parameter.

Step: the gradient partitions are unscaled (fp16), the global norm is one all-reduce of the
partitions' squared norms, clipping and the optimizer update act on the partitions, the fp32
master is copied into the model-dtype partition, and the parameters that stay whole
(persistent ones) are gathered again.

Offloading (``offload_param`` / ``offload_optimizer``): the ``offload_device`` plugins the config
names are storage; this stage keeps partitions there through :mod:`.offload_params` (the
parameter partitioner for that device) and :mod:`.offload_store` (the partition store that
replaces :class:`InMemoryPartitions`: where masters and optimizer state live, and the step); see
docs/offload.md.

ZeRO++ (``zero_quantized_weights`` / ``zero_quantized_nontrainable_weights`` /
``zero_quantized_gradients`` / ``zero_hpz_partition_size``): :mod:`.zeropp`
supplies the partitioner's ``wire`` (int8 forward / backward gathers, hpZ's secondary shards) and
the reducer's quantized all-to-all; the fp32 master and the partitions stay exact.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional

import torch

from dsplug.contracts import ZeroStage
from dsplug.logging import log_rank0

from ..checkpoint import deepspeed_format as dsf
from ..partitioning.gradients import comm_dtype, fp64_square_sum, unscale_check_clip
from ..partitioning.offload import open_devices
from ..partitioning.reductions import overlap_bucket_elements, refuse_other_reductions
from .checkpoint import CheckpointFormatError, check_partitioned, consolidate, flatten_group_state, is_elementwise
from .coordinator import ParamCoordinator
from .offload_params import param_partitioner
from .offload_store import OffloadedPartitions
from .partitioned_param import ParamPartitioner, ZeroParamStatus, is_partitioned, piece_of, unique
from .traits import TRAITS
from .reduce import GradientReducer
from .wrapper_internals import Stage3WrapperInternals
from .zeropp import build_zeropp, secondary_tensors


class _Group:
    """One optimizer param group's partitions: flat buffers and per-parameter views into them.

    ``flat`` (model dtype) backs the parameters' ``ds_tensor``; ``master`` (fp32) is a separate copy
    with master weights and ``flat`` itself otherwise; ``views`` are the master pieces the optimizer
    steps; ``grad`` (the gradient accumulation dtype) holds the reduced gradient partitions.

    The methods below are what the stage asks of a group; an offload plugin's groups
    (``offload_optimizer`` / ``offload_param``) answer the same questions with their own storage."""

    def __init__(self, params: List[torch.nn.Parameter], dtype, master: bool, device):
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.flat = torch.empty(sum(self.sizes), dtype=dtype, device=device)
        for p, offset, k in zip(params, self.offsets, self.sizes):
            self.flat[offset:offset + k].copy_(p.ds_tensor)
            p.ds_tensor = self.flat[offset:offset + k]
        self.master = self.flat.to(torch.float32, copy=True) if master else self.flat
        self.views = self._split(self.master)
        self._grad: Optional[torch.Tensor] = None
        self._grad_views: List[torch.Tensor] = []
        #: per view: nothing accumulated since zero_grad (its memory holds stale values; reads see zeros)
        self._fresh: List[bool] = []

    def allocate_grads(self, dtype) -> None:
        self._grad = torch.empty(self.flat.numel(), dtype=dtype, device=self.flat.device)
        self._grad_views = self._split(self._grad)
        self._fresh = [True] * len(self._grad_views)

    @property
    def grad(self) -> Optional[torch.Tensor]:
        """The gradient partitions, flat (the accumulation dtype)."""
        self._settle()
        return self._grad

    @property
    def grad_views(self) -> List[torch.Tensor]:
        self._settle()
        return self._grad_views

    def accumulate(self, i: int, piece: torch.Tensor) -> bool:
        """Add a reduced gradient piece into parameter ``i``'s partition. zero_grad does not zero the
        partitions: the first piece after it is copied in instead (a pass over the gradients saved
        each step), and a partition that got none is zeroed when the gradients are read."""
        view = self._grad_views[i]
        if self._fresh[i]:
            view.copy_(piece)
            self._fresh[i] = False
        else:
            view.add_(piece)
        return True

    def claim(self, i: int, dtype) -> Optional[torch.Tensor]:
        """Parameter ``i``'s gradient partition, to be written whole by its reduction, when it has
        ``dtype`` and nothing was accumulated into it since zero_grad (else None: the piece is
        accumulated)."""
        if not self._fresh[i] or self._grad_views[i].dtype != dtype:
            return None
        self._fresh[i] = False
        return self._grad_views[i]

    def _settle(self) -> None:
        if any(self._fresh):
            for i, fresh in enumerate(self._fresh):
                if fresh:
                    self._grad_views[i].zero_()
            self._fresh = [False] * len(self._fresh)

    def _split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o:o + k] for o, k in zip(self.offsets, self.sizes)]

    @property
    def numel(self) -> int:
        return sum(p.ds_numel for p in self.params)

    def attach_grads(self) -> List[torch.Tensor]:
        """Give every view its fp32 gradient; returns the tensors to unscale / measure / clip."""
        flat = self.grad if self.grad.dtype == torch.float32 else self.grad.float()
        for view, offset, k in zip(self.views, self.offsets, self.sizes):
            view.grad = flat[offset:offset + k]
        return [flat]

    def zero_grad(self) -> None:
        for view in self.views:
            view.grad = None
        self._fresh = [True] * len(self._grad_views)

    def update_partitions(self) -> None:
        """Model-dtype partitions := fp32 master (after a step)."""
        if self.master is not self.flat:
            self.flat.copy_(self.master)

    def master_fp32(self) -> torch.Tensor:
        return self.master.detach().to(torch.float32)

    def load_master(self, fp32: torch.Tensor, from_fp32: bool) -> None:
        """Master (and partitions) from a checkpoint's fp32 partition; ``from_fp32=False``: the master
        follows the model-dtype partitions instead (``load_from_fp32_weights: false``)."""
        if self.master is self.flat or from_fp32:
            self.master.copy_(fp32)
        if self.master is not self.flat:
            if from_fp32:
                self.flat.copy_(self.master)
            else:
                self.master.copy_(self.flat)

    def set_master_piece(self, i: int, piece: torch.Tensor) -> None:
        """Parameter ``i``'s partition was rewritten with ``piece``: the master follows."""
        if self.master is not self.flat:
            self.views[i].copy_(piece)

    def master_from_partitions(self) -> None:
        if self.master is not self.flat:
            self.master.copy_(self.flat)

    def memory_tensors(self) -> Dict[str, List[torch.Tensor]]:
        return {"optimizer_states": [self.master] if self.master is not self.flat else []}


class InMemoryPartitions:
    """Where stage 3 keeps partitions, master weights and optimizer state without offloading:
    everything in flat buffers on the partition device, stepped by one optimizer.

    The interface (``groups``, ``build_optimizer``, ``step``, ``materialized``, ``memory``,
    ``close``) is the seam an ``offload_device`` plugin fills with its own storage."""

    #: gradient partitions kept outside the groups (an offload store's SwappedGradients); None here
    grads = None

    def __init__(self, param_groups: List[dict], model_dtype, master_weights: bool, partitioner):
        self.groups = [_Group(g["params"], model_dtype, master_weights, partitioner.partition_device)
                       for g in param_groups]

    def build_optimizer(self, param_groups: List[dict], build_optimizer):
        return build_optimizer([{**g, "params": grp.views} for g, grp in zip(param_groups, self.groups)])

    def step(self, optimizer) -> None:
        """The optimizer update, then the model-dtype partitions from the master."""
        optimizer.step()
        with torch.no_grad():
            for grp in self.groups:
                grp.update_partitions()

    @contextlib.contextmanager
    def materialized(self, write: bool = False):
        """Views and optimizer state are resident (checkpoint save / load may read and replace them)."""
        yield

    def state_loaded(self) -> None:
        """The optimizer's state was replaced by a checkpoint load (nothing to move here)."""

    def memory(self, optimizer, params) -> Dict[str, List[torch.Tensor]]:
        """Tensors held now: ``parameters`` (the partitions of ``params``) and ``optimizer_states``."""
        optim = [t for grp in self.groups for t in grp.memory_tensors()["optimizer_states"]]
        if optimizer is not None:
            optim += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"parameters": [p.ds_tensor for p in params], "optimizer_states": optim}

    def close(self) -> None:
        pass


class PartitionedParamStage(dsf.DeepSpeedInterchange, ZeroStage):
    stage = 3
    traits = TRAITS

    def __init__(self, module: torch.nn.Module, param_groups: List[dict], build_optimizer, precision, zero_config,
                 context):
        refuse_other_reductions(param_groups, context.reduction_of, 3)
        kernel = context.config.kernel
        self.module = module
        self.precision = precision
        self.context = context
        self.comm = context.comm
        self.rank, self.world_size = context.rank, context.world_size
        self.zero_config = zero_config
        self.clip = float(kernel.gradient_clipping or 0.0)
        self.model_dtype = precision.model_dtype
        self.accum_dtype = precision.grad_accum_dtype or precision.model_dtype
        accelerator = context.accelerator
        device = accelerator.device(context.local_rank if accelerator.name != "cpu" else None)
        #: the offload devices of "offload_param" / "offload_optimizer" (absent: not offloaded)
        self.offload = open_devices(zero_config, context)
        try:
            self._build(module, param_groups, build_optimizer, precision, zero_config, context, device)
        except BaseException:
            for opened in self.offload.values():
                opened.close()
            raise

    def _build(self, module, param_groups, build_optimizer, precision, zero_config, context, device) -> None:
        kernel = context.config.kernel
        if "offload_param" in self.offload:
            self.partitioner = param_partitioner(self.offload["offload_param"], self.comm, self.rank, self.world_size,
                                                 device, zero_config.offload_param)
        else:
            self.partitioner = ParamPartitioner(self.comm, self.rank, self.world_size, device)

        if self.partitioner.device.type == "cpu":  # (an accelerator's caching allocator keeps them itself)
            self.partitioner.keep_limit = int(zero_config.stage3_max_live_parameters)

        #: ZeRO++ (None when every ZeRO++ key is off); checks zero_hpz_partition_size against the world
        self.zeropp = build_zeropp(zero_config, self.comm, self.rank, self.world_size)
        if self.zeropp is not None:
            self.partitioner.wire = self.zeropp.wire

        named = list(module.named_parameters())
        self.names: Dict[int, str] = {id(p): n for n, p in named}
        self.all_params = [p for _, p in named]
        self.partitioner.partition([p for p in self.all_params if not is_partitioned(p)], dtype=self.model_dtype)
        for p in self.all_params:
            self.partitioner.adopt(p, dtype=self.model_dtype)
        _check_groups(param_groups, self.names)

        if self.offload:  # masters and states in the offload devices (the partitioner holds the param device)
            self.store = OffloadedPartitions(param_groups, self.model_dtype, precision.master_weights,
                                             self.partitioner, zero_config, context,
                                             self.offload.get("offload_optimizer"))
        else:
            self.store = InMemoryPartitions(param_groups, self.model_dtype, precision.master_weights,
                                            self.partitioner)
        self.groups = self.store.groups
        self.optimizer = self.store.build_optimizer(param_groups, build_optimizer)
        if self.optimizer is not None:  # (None: inference only)
            _check_fresh(self.optimizer, self.groups)
            for grp in self.groups:
                grp.allocate_grads(self.accum_dtype)
        self.place: Dict[int, tuple] = {id(p): (gi, i) for gi, grp in enumerate(self.groups)
                                        for i, p in enumerate(grp.params)}

        self.persistent = _persistent(self.all_params, zero_config.stage3_param_persistence_threshold,
                                      zero_config.stage3_model_persistence_threshold)
        self.partitioner.make_persistent(self.persistent)
        self.partitioner.update_listeners.append(self._master_from_partitions)

        self.coordinator = ParamCoordinator(
            self.partitioner, module, prefetch_bucket_size=zero_config.stage3_prefetch_bucket_size,
            max_live_parameters=zero_config.stage3_max_live_parameters,
            max_reuse_distance=zero_config.stage3_max_reuse_distance,
            granularity_threshold=zero_config.stage3_module_granularity_threshold,
            log_trace_warnings=zero_config.log_trace_cache_warnings)
        self.coordinator.install()
        self.reducer = GradientReducer(
            self.comm, self.rank, self.world_size, comm_dtype(kernel, self.accum_dtype),
            bucket_elements=self._reduce_bucket_elements(zero_config), prescale=kernel.prescale_gradients,
            predivide=kernel.gradient_predivide_factor, use_reduce_scatter=zero_config.reduce_scatter,
            overlap=zero_config.overlap_comm, accumulate=self._accumulate,
            quantized=self.zeropp.gradients if self.zeropp is not None else None, claim=self._claim)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.all_params
                       if p.requires_grad]
        self.last_grad_norm: Optional[float] = None
        #: DeepSpeed's ZeRO-3 optimizer internals, read through engine.optimizer
        self.wrapper_internals = Stage3WrapperInternals(self)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        grad, p.grad = p.grad, None
        if grad is not None and id(p) in self.place and self.optimizer is not None:
            self.reducer.add(p, grad)
        self.coordinator.param_done(p)

    def _claim(self, p, dtype) -> Optional[torch.Tensor]:
        gi, i = self.place[id(p)]
        return self.groups[gi].claim(i, dtype)

    def _accumulate(self, p, piece: torch.Tensor) -> None:
        gi, i = self.place[id(p)]
        if not self.groups[gi].accumulate(i, piece):  # a swapped sub-group's gradient (offload_optimizer on nvme)
            self.store.grads.add(gi, i, piece)

    def before_backward(self, is_boundary: bool) -> None:
        """Gradients are reduce-scattered every micro-step (stage 3 keeps only partitions)."""
        self.coordinator.in_backward = True

    def after_backward(self) -> None:
        self.reducer.finish()
        if self.store.grads is not None:
            self.store.grads.end_backward()
        self.coordinator.in_backward = False
        self.coordinator.end_pass()

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Apply one optimizer step; return False if an overflow skipped it."""
        if self.optimizer is None:
            raise RuntimeError("ZeRO stage 3: step() without an optimizer")
        grads = self._master_grads()
        apply, self.last_grad_norm = unscale_check_clip(grads, self.precision, self.clip, self._global_norm,
                                                        deferred=self.store.grads)
        if not apply:
            self.zero_grad()
            return False
        self.store.step(self.optimizer)
        self.partitioner.partitions_changed()
        self._partitions_from_master()
        self.zero_grad()
        return True

    def _reduce_bucket_elements(self, zero_config) -> int:
        """``reduce_bucket_size``; with ``overlap_comm`` at most OVERLAP_BUCKET_ELEMENTS, so that the
        reduce-scatters run while backward goes on (ZeRO++'s quantized gradients keep the
        configured size: their quantization blocks follow the bucket)."""
        quantized = self.zeropp is not None and self.zeropp.gradients is not None
        if zero_config.overlap_comm and not quantized:
            return overlap_bucket_elements(zero_config.reduce_bucket_size)
        return int(zero_config.reduce_bucket_size)

    def _master_grads(self) -> List[torch.Tensor]:
        return [g for grp in self.groups for g in grp.attach_grads()]

    def _global_norm(self, grads: List[torch.Tensor]) -> float:
        # in fp64, as DeepSpeed's stage 3 (its last bit matters under bf16: see stage12's _global_norm)
        device = self.partitioner.device
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            squares += fp64_square_sum(g).to(device)
        if self.store.grads is not None:
            squares += self.store.grads.squares()
        self.comm.all_reduce(squares)
        return float(squares.sqrt())

    def _partitions_from_master(self) -> None:
        """After the update (the store wrote the model-dtype partitions): whole parameters are gathered again."""
        self.coordinator.end_pass()
        self._gather_whole_again()

    def _gather_whole_again(self) -> None:
        """After the partitions changed (a step, a load): what was whole is gathered again, and so
        are the persistent parameters ``empty_partition_cache`` released (as DeepSpeed re-gathers
        its persistent parameters after each step and load)."""
        self.partitioner.refresh([p for p in self.all_params if p.ds_status is ZeroParamStatus.AVAILABLE])
        self._gather_released_persistent()

    def _gather_released_persistent(self) -> None:
        """Persistent parameters ``empty_partition_cache`` released (on every rank) are whole again."""
        released = [p for p in self.persistent if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if released:
            self.partitioner.fetch(released)

    def _master_from_partitions(self, params) -> None:
        """Partitions were rewritten from full values (GatheredParameters with a modifier_rank)."""
        with torch.no_grad(), self.store.materialized(write=True):
            for p in params:
                where = self.place.get(id(p))
                if where is not None:
                    self.groups[where[0]].set_master_piece(where[1], self.partitioner.read_piece(p))

    def gathered(self, params, modifier_rank: Optional[int] = None):
        """The contract's gather: :class:`.gathered.PartitionedGathered` of ``params`` (None when
        none of them is partitioned)."""
        from .gathered import PartitionedGathered

        context = PartitionedGathered(params, modifier_rank=modifier_rank)
        return context if context.enabled else None

    def zero_grad(self) -> None:
        for p in self.all_params:
            p.grad = None
        for grp in self.groups:
            grp.zero_grad()
        if self.store.grads is not None:
            self.store.grads.reset()

    # ------------------------------------------------------------------ memory
    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes held by this rank's tensors now (what ``engine.model_state_memory()`` reports).

        ``parameters``: the partitions; ``gathered_parameters``: full values present now (persistent
        parameters, plus any gathered at the moment); ``gradients``: gradient partitions;
        ``optimizer_states``: the fp32 master partitions (when separate from the parameters) and the
        optimizer's state; ``hpz_secondary`` (ZeRO++ hpZ only): the secondary shards;
        ``buffers``: gradient buckets and all-gather buffers in flight, and those kept for reuse;
        ``total``: all but the buffers."""
        held = self.store.memory(self.optimizer, self.all_params)
        partitions = held["parameters"]
        gathered = [p.data for p in self.all_params if p.ds_status is ZeroParamStatus.AVAILABLE]
        grads = [grp.grad for grp in self.groups if grp.grad is not None]
        grads += [p.grad for p in self.all_params if p.grad is not None]
        optim = held["optimizer_states"]
        in_flight = {id(p._ds_handle): p._ds_handle for p in self.all_params if p._ds_handle is not None}
        buffers = [g for _, g in self.reducer.pending] + self.reducer.in_flight_buffers()
        buffers += self.reducer.kept_buffers() + self.partitioner.kept_buffers()
        buffers += [b for h in in_flight.values() for b in h.buffers()]
        report = {"parameters": _storage_bytes(partitions), "gathered_parameters": _storage_bytes(gathered),
                  "gradients": _storage_bytes(grads), "optimizer_states": _storage_bytes(optim),
                  "buffers": _storage_bytes(buffers)}
        if self.zeropp is not None and self.zeropp.hpz > 1:  # ZeRO++ hpZ: the secondary shards
            report["hpz_secondary"] = _storage_bytes(secondary_tensors(self.all_params))
        report["total"] = sum(v for k, v in report.items() if k != "buffers")
        return report

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """This rank's partitions in the ``per_param`` layout of docs/zero-stages.md."""
        groups = []
        with self.store.materialized():
            for gi, grp in enumerate(self.groups):
                opt_group = self.optimizer.param_groups[gi] if self.optimizer is not None else {}
                groups.append({
                    "names": [self.names[id(p)] for p in grp.params],
                    "shapes": [torch.Size(p.ds_shape) for p in grp.params],
                    "numel": grp.numel,
                    "partition_numel": sum(grp.sizes),
                    "fp32": grp.master_fp32(),
                    "state": flatten_group_state(self.optimizer, grp.views) if self.optimizer is not None else {},
                    "hyper": {k: v for k, v in opt_group.items() if k != "params"},
                })
        return {"zero_stage": 3, "layout": "per_param", "world_size": self.world_size, "rank": self.rank,
                "groups": groups}

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True, saved_world_size: Optional[int] = None,
                        read_rank=None, **_unused) -> None:
        """Restore partitions; a checkpoint of another world size (or layout) is re-sliced."""
        check_partitioned(state)
        own_names = [[self.names[id(p)] for p in grp.params] for grp in self.groups]
        same_slicing = (state["layout"] == "per_param" and int(state["world_size"]) == self.world_size
                        and int(state["rank"]) == self.rank and [g["names"] for g in state["groups"]] == own_names)
        if same_slicing:
            pieces = [self._own_pieces(grp, g) for grp, g in zip(self.groups, state["groups"])]
        else:
            saved = int(state["world_size"])
            if read_rank is None and saved > 1:
                raise CheckpointFormatError("re-slicing a partitioned checkpoint needs every rank's state (read_rank)")
            ranks = [state if int(state["rank"]) == r else read_rank(r) for r in range(saved)]
            for r, s in enumerate(ranks):
                check_partitioned(s, f"rank {r}'s optimizer state file")
            pieces = self._pieces_from_full(consolidate(ranks))
        load_fp32 = bool(getattr(self.zero_config, "load_from_fp32_weights", True))
        with torch.no_grad(), self.store.materialized(write=True):
            for gi, (grp, (fp32, per_view, hyper)) in enumerate(zip(self.groups, pieces)):
                grp.load_master(fp32, load_fp32)
                if load_optimizer_states and self.optimizer is not None:
                    for view, st in zip(grp.views, per_view):
                        self.optimizer.state[view] = {k: (v.to(device=view.device, dtype=view.dtype)
                                                          if torch.is_tensor(v) and v.dim() == 1 else
                                                          (v.clone() if torch.is_tensor(v) else v))
                                                      for k, v in st.items()}
                    self.optimizer.param_groups[gi].update({k: v for k, v in hyper.items() if k != "params"})
            if load_optimizer_states and self.optimizer is not None:
                self.store.state_loaded()
        self.partitioner.partitions_changed()
        self._gather_whole_again()

    def _own_pieces(self, grp: _Group, saved: dict):
        """(fp32 flat, [state of each view], hyper) from this rank's own saved group (same slicing)."""
        if saved["fp32"].numel() != sum(grp.sizes):
            raise CheckpointFormatError(f"the saved partition holds {saved['fp32'].numel()} elements, this rank owns "
                                        f"{sum(grp.sizes)}")
        numel = saved["partition_numel"]
        elementwise = {k: v for k, v in saved["state"].items() if is_elementwise(v, numel)}
        scalars = {k: v for k, v in saved["state"].items() if k not in elementwise}
        per_view = []
        for offset, k in zip(grp.offsets, grp.sizes):
            st = {key: flat[offset:offset + k] for key, flat in elementwise.items()}
            st.update(scalars)
            per_view.append(st)
        return saved["fp32"], per_view, saved.get("hyper", {})

    def _pieces_from_full(self, full: Dict[str, dict]):
        out = []
        for grp in self.groups:
            names = [self.names[id(p)] for p in grp.params]
            missing = [n for n in names if n not in full]
            if missing:
                raise CheckpointFormatError(f"the checkpoint has no parameter named {', '.join(missing[:5])}"
                                            f"{' ...' if len(missing) > 5 else ''} (it holds "
                                            f"{', '.join(list(full)[:8])}{' ...' if len(full) > 8 else ''})")
            fp32, per_view = [], []
            for name, p in zip(names, grp.params):
                entry = full[name]
                if tuple(entry["fp32"].shape) != tuple(p.ds_shape):
                    raise CheckpointFormatError(f"parameter {name}: the checkpoint holds shape "
                                                f"{tuple(entry['fp32'].shape)}, the model {tuple(p.ds_shape)}")
                fp32.append(piece_of(entry["fp32"], self.rank, self.world_size))
                st = {k: piece_of(v, self.rank, self.world_size) for k, v in entry["state"].items()}
                st.update(entry["scalars"])
                per_view.append(st)
            out.append((torch.cat(fp32) if fp32 else torch.zeros(0), per_view, full[names[0]]["hyper"]))
        return out

    # ------------------------------------------------------------------ DeepSpeed's keys (checkpoint hooks)
    def _ds_param_shapes(self):
        """DeepSpeed's ``param_shapes``: one name -> shape map per ZeRO-3 sub-group."""
        size = getattr(self.zero_config, "sub_group_size", None)
        shapes = []
        for grp in self.groups:
            names = [self.names[id(p)] for p in grp.params]
            shapes += dsf.zero3_sub_group_shapes(names, [torch.Size(p.ds_shape) for p in grp.params],
                                                 self.world_size, size)
        return shapes

    def _ds_model_keys(self, engine) -> dict:
        return dsf.model_keys(self, param_shapes=self._ds_param_shapes(), world_size=self.world_size)

    def _ds_rank_keys(self, engine, state, options) -> dict:
        if self.optimizer is None:
            return {}
        keys = dsf.zero3_keys(state, self.precision, self.optimizer.param_groups,
                              getattr(self.zero_config, "sub_group_size", None), records=dsf.records_allowed(self))
        config = dsf._config_dict(self)
        keys.update(ds_config=config, ds_version=dsf.DS_VERSION)
        # DeepSpeed reads each rank's own model file at stage 3: counters and metadata, and the
        # module with every partitioned parameter as an empty tensor (its weights come from the
        # fp32 partitions)
        entries = self.module.state_dict(keep_vars=True)
        module = {k: (torch.empty(0, dtype=v.dtype) if is_partitioned(v) else v.detach()) for k, v in entries.items()}
        scheduler = getattr(engine, "lr_scheduler", None)
        model_file = {"module": module, **self._ds_model_keys(engine),
                      "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                      "global_steps": int(getattr(engine, "global_steps", 0)),
                      "global_samples": int(getattr(engine, "global_samples", 0)),
                      "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
                      "ds_config": config}
        links = {}
        if self.model_dtype == torch.bfloat16:  # DeepSpeed reads bf16_zero_pp_rank_* then
            links[dsf.optim_file(self.rank, True)] = dsf.optim_file(self.rank)
        dsf.write_extra_files(options, self.rank, {dsf.zero_model_file(self.rank): model_file}, links)
        return keys

    # ------------------------------------------------------------------ module state
    def module_state_dict(self) -> dict:
        """The full module state dict (collective: every rank calls it, every rank gets it).

        Parameters are gathered ``allgather_bucket_size`` elements at a time and copied out."""
        entries = self.module.state_dict(keep_vars=True)
        params = unique(v for v in entries.values() if is_partitioned(v))
        full: Dict[int, torch.Tensor] = {}
        limit = max(1, int(self.zero_config.allgather_bucket_size))
        chunk, size = [], 0
        for p in params + [None]:
            if p is not None and (not chunk or size + p.ds_numel <= limit):
                chunk.append(p)
                size += p.ds_numel
                continue
            self.partitioner.hold(chunk, +1)
            try:
                self.partitioner.fetch(chunk)
                for q in chunk:
                    full[q.ds_id] = q.data.detach().clone()
            finally:
                self.partitioner.hold(chunk, -1)
                self.partitioner.release(chunk)
            chunk, size = ([p], p.ds_numel) if p is not None else ([], 0)
        return {k: full[v.ds_id] if is_partitioned(v) else v.detach() for k, v in entries.items()}

    def load_module_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a full module state dict: every rank keeps its slice (no communication, unless
        ``empty_partition_cache`` released persistent parameters: those are gathered again)."""
        entries = self.module.state_dict(keep_vars=True)
        missing = [k for k in entries if k not in state]
        unexpected = [k for k in state if k not in entries]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: "
                               f"missing keys {missing}, unexpected keys {unexpected}")
        others, done = {}, set()
        with torch.no_grad(), self.store.materialized(write=True):
            for key, target in entries.items():
                if key not in state:
                    continue
                if not is_partitioned(target):
                    others[key] = state[key]
                    continue
                if target.ds_id in done:
                    continue
                done.add(target.ds_id)
                value = state[key]
                if tuple(value.shape) != tuple(target.ds_shape):
                    raise RuntimeError(f"loading state_dict: {key} has shape {tuple(value.shape)} in the checkpoint "
                                       f"and {tuple(target.ds_shape)} in the model")
                piece = piece_of(value.to(self.partitioner.partition_device), self.rank, self.world_size)
                self.partitioner.store_piece(target, piece)
                if target.ds_status is ZeroParamStatus.AVAILABLE:
                    target.data.copy_(value)
                where = self.place.get(id(target))
                if where is not None:
                    self.groups[where[0]].set_master_piece(where[1], piece)
        self.partitioner.partitions_changed()
        self._gather_released_persistent()  # as after a full load
        if others:
            self.module.load_state_dict(others, strict=False)

    def sixteen_bit_state_dict(self) -> Optional[dict]:
        """The gathered module weights for ``save_16bit_model``, only with
        ``stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed); else None (logged)."""
        if not self.zero_config.stage3_gather_16bit_weights_on_model_save:
            log_rank0("warning: save_16bit_model at ZeRO stage 3 needs zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save=true; nothing saved", logging.WARNING)
            return None
        return self.module_state_dict()

    # ------------------------------------------------------------------ full values of one parameter
    # Every rank holds ceil(n/N) elements of each parameter (the per_param layout): a full value is
    # one all-gather of those pieces.
    def _where(self, param):
        """``(group, index)`` of a parameter the stage trains, else None."""
        return self.place.get(id(param))

    def _gather_piece(self, param, piece: torch.Tensor) -> torch.Tensor:
        piece = piece.detach().to(device=self.partitioner.device, dtype=torch.float32).reshape(-1)
        if self.world_size == 1:
            full = piece.clone()
        else:
            full = torch.empty(self.world_size * piece.numel(), dtype=torch.float32, device=piece.device)
            self.comm.all_gather_into_tensor(full, piece.contiguous())
        return full[:param.ds_numel].view(param.ds_shape)

    def full_fp32_param(self, param) -> Optional[torch.Tensor]:
        where = self._where(param)
        if where is None:
            return None
        with self.store.materialized():
            piece = self.groups[where[0]].views[where[1]].detach().to(torch.float32, copy=True)
        return self._gather_piece(param, piece)

    def set_full_fp32_param(self, param, value: torch.Tensor) -> None:
        where = self._where(param)
        if where is None:
            return
        value = value.detach()
        piece = piece_of(value.to(self.partitioner.partition_device, torch.float32), self.rank, self.world_size)
        with torch.no_grad(), self.store.materialized(write=True):
            self.partitioner.store_piece(param, piece)
            self.groups[where[0]].set_master_piece(where[1], piece)
            self.partitioner.partitions_changed()
            if param.ds_status is ZeroParamStatus.AVAILABLE:
                param.data.copy_(value)

    def full_grad(self, param) -> Optional[torch.Tensor]:
        where = self._where(param)
        grp = None if where is None else self.groups[where[0]]
        if grp is not None and grp.grad_views and grp.grad_views[where[1]] is None:
            grads = self.store.grads  # a swapped sub-group's gradient: read back (factor not applied yet)
            return self._gather_piece(param, grads.piece(*where)) if grads.has_gradients() else None
        if grp is None or grp.grad is None:
            return None
        return self._gather_piece(param, grp.grad_views[where[1]])

    def _state_of(self, param, key: str):
        where = self._where(param)
        if where is None or self.optimizer is None:
            return None, None
        view = self.groups[where[0]].views[where[1]]
        return view, self.optimizer.state.get(view, {}).get(key)

    def full_optimizer_state(self, param, key: str):
        with self.store.materialized():
            view, value = self._state_of(param, key)
            if value is None:
                return None
            if not is_elementwise(value, view.numel()):
                return value.clone() if torch.is_tensor(value) else value
            piece = value.detach().to(torch.float32, copy=True)
        return self._gather_piece(param, piece)

    def set_full_optimizer_state(self, param, key: str, value: torch.Tensor) -> None:
        with torch.no_grad(), self.store.materialized(write=True):
            view, current = self._state_of(param, key)
            if current is None:
                raise KeyError(f"the optimizer has no state {key!r} for this parameter yet (it is created by the "
                               "first step)")
            current.copy_(piece_of(value.detach().to(current.device, current.dtype), self.rank, self.world_size))

    def refresh_master_from_model(self) -> None:
        with torch.no_grad(), self.store.materialized(write=True):
            for grp in self.groups:
                grp.master_from_partitions()

    def release_gathered(self) -> None:
        """Drop every gathered parameter that no context holds, the persistent ones included (as
        DeepSpeed's ``empty_partition_cache``): those are gathered again when the next forward
        starts. The coordinator's trace is kept: the next pass prefetches as before."""
        self.partitioner.release_all()
        self.coordinator.refetch_at_next_forward(self.partitioner.release_persistent(self.persistent))

    def close(self) -> None:
        """Remove hooks and release the store (an offload plugin deletes its swap files here)."""
        self.coordinator.remove()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.all_params:  # ZeRO++ hpZ's secondary shards
            for name in ("_ds_secondary", "_ds_secondary_gen"):
                if hasattr(p, name):
                    delattr(p, name)
        self.store.close()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen, size = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if t.numel() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            size += storage.nbytes()
    return size


def _check_groups(param_groups, names: Dict[int, str]) -> None:
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param group {gi} holds a parameter (shape {tuple(p.shape)}) that is not a "
                                 "parameter of the model; ZeRO stage 3 partitions only the model's own parameters")


def _check_fresh(optimizer, groups) -> None:
    own = {id(v) for grp in groups for v in grp.views}
    if any(id(k) not in own for k in optimizer.state):
        raise ValueError("the client optimizer already has state for the full parameters; at ZeRO stage 3 pass a "
                         "fresh optimizer (or a callable that builds one from the param groups)")


def _persistent(params, threshold: int, model_threshold: int) -> List[torch.nn.Parameter]:
    """Parameters of at most ``threshold`` elements stay whole, up to ``model_threshold`` in total."""
    chosen, total = [], 0
    for p in params:
        if p.ds_numel <= threshold and total + p.ds_numel <= model_threshold:
            chosen.append(p)
            total += p.ds_numel
    return chosen
