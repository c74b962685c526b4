"""The ZeRO stage ``fsdp2``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) driven through
dsplug's :class:`dsplug.contracts.ZeroStage` contract.

Building: the model is cut into FSDP2 units (:func:`units_to_shard`, ``zero_optimization.wrap``)
and each unit, then the model itself, is ``fully_shard``-ed over a device mesh of the data-parallel
group (``context.comm.group``). The module's parameters are replaced by FSDP2's DTensor
parameters, which the contract allows a factory to do. Every parameter becomes a DTensor whose local tensor holds this rank's
rows (:mod:`.rows`); FSDP2 gathers a unit's parameters just before its forward / backward and
frees them after, and reduce-scatters its gradients into sharded gradients after its backward.
Both collectives go through ``context.comm`` (:mod:`.collectives`).

Precision: fp32; bf16 and fp16 with fp32 master weights through FSDP2's
``MixedPrecisionPolicy`` (the sharded parameters stay fp32: they are the masters; each gather casts
them to the training dtype; gradients are reduced in ``communication_data_type`` / the training
dtype as dsplug's stages do, and land in fp32 shards). Anything else is refused when the stage is
built.

Optimizer: ``build_optimizer`` gets plain tensors that alias the DTensors' local rows (the same
storage), so every dsplug optimizer works (the native CPU Adam included) and steps exactly the
rows this rank owns; an element-wise optimizer then gives what it gives on whole tensors. One
that looks at whole tensors sees this rank's rows instead, as at ZeRO stages 1-3 (LAMB's trust
ratio); the 1-bit optimizers and untested ones are refused by their config rules from the traits
(``partitions_optimizer_states``).

Step: unscale the fp32 gradient rows, the global norm is one all-reduce of the squared norms of
every rank's rows (no padding is counted), overflow check, clip, step, drop the gradients.
Gradients are reduce-scattered at every micro-step (as at ZeRO stage 3: only shards are kept
between micro-steps) and accumulate in the fp32 gradient shards.

Full values (``dsplug.zero.GatheredParameters``, :meth:`Fsdp2Stage.gathered`): each parameter's
rows are all-gathered into a plain full Parameter put in the module in the DTensor's place for
the block; with a ``modifier_rank`` that rank's full values are broadcast and every rank copies
its rows back into the sharded (master) parameter; the DTensor parameter returns on exit.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

from dsplug.config.schema import ConfigError, Issue
from dsplug.contracts import ZeroStage
from dsplug.logging import log_rank0

from . import checkpoint as ckpt
from .collectives import CommAllGather, CommReduceScatter
from .config import STAGE_NAME
from .rows import gather_rows, rows_of
from .traits import TRAITS

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Fsdp2Stage(ZeroStage):
    stage = STAGE_NAME
    traits = TRAITS

    def __init__(self, module: torch.nn.Module, param_groups: List[dict], build_optimizer: Callable,
                 precision, zero_config, context):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: this model was already sharded by FSDP2 (an earlier engine "
                             "built on it); FSDP2 cannot be undone, so build the engine on a fresh model")
        kernel = context.config.kernel
        self.module = module
        self.precision = precision
        self.context = context
        self.comm = context.comm
        self.rank, self.world_size = context.rank, context.world_size
        self.clip = float(kernel.gradient_clipping or 0.0)
        self.load_from_fp32 = bool(zero_config.load_from_fp32_weights)
        self.ignore_unused = bool(zero_config.ignore_unused_parameters)
        self.last_grad_norm: Optional[float] = None
        self.model_dtype, param_dtype, reduce_dtype = _dtypes(precision, context)
        self.master_weights = param_dtype is not None
        _refuse_expert_parameters(module)

        names_before = {id(p): n for n, p in module.named_parameters()}
        group_names = []
        for i, group in enumerate(param_groups):
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in names_before]
            if missing:
                raise ValueError(f"ZeRO stage {STAGE_NAME!r}: optimizer param group {i} holds parameters that are "
                                 f"not the model's (shapes {missing}); FSDP2 shards the model's own parameters")
            group_names.append([names_before[id(p)] for p in group["params"]])

        _check_torch(module)
        options = context.config.selected_params("zero_stage")  # this stage's keys of zero_optimization
        units = units_to_shard(module, options.wrap)  # (checked before the model is touched)
        if self.master_weights:  # the sharded parameters are the fp32 masters (buffers keep the training dtype)
            with torch.no_grad():
                for p in module.parameters():
                    p.data = p.data.to(torch.float32)
        self._shard(module, units, options, param_dtype, reduce_dtype, kernel, zero_config)

        #: name -> the module's DTensor parameter; name -> plain tensor aliasing its local rows
        self.params: Dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        self.local: Dict[str, torch.nn.Parameter] = {}
        self.rows: Dict[str, tuple] = {}
        with torch.no_grad():
            for name, p in self.params.items():
                local = p.to_local()
                start, length = rows_of(p.shape[0], self.world_size, self.rank)
                if local.shape[0] != length or not local.is_contiguous():
                    raise RuntimeError(f"ZeRO stage {STAGE_NAME!r}: FSDP2 gave rank {self.rank} the local shape "
                                       f"{tuple(local.shape)} of {name!r} {tuple(p.shape)}; this stage expects "
                                       f"{length} contiguous rows (torch.chunk along dim 0); torch "
                                       f"{torch.__version__} shards differently")
                self.local[name] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
                self.rows[name] = (start, length)
        self.name_of_local = {id(t): n for n, t in self.local.items()}
        self.name_of_param = {id(p): n for n, p in self.params.items()}
        self.trained = [n for names in group_names for n in names]
        self.trained_set = set(self.trained)
        self.optimizer = build_optimizer([{**g, "params": [self.local[n] for n in names]}
                                          for g, names in zip(param_groups, group_names)])
        if self.optimizer is not None and self.optimizer.state:
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: the optimizer already has state; pass a fresh optimizer "
                             "(its state would not match the sharded parameters)")

    # ------------------------------------------------------------------ building
    def _shard(self, module, units, options, param_dtype, reduce_dtype, kernel, zero_config) -> None:
        """``fully_shard`` each unit, then the model, over the data-parallel group's mesh, with
        both collectives through ``context.comm``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        device_type = next(module.parameters()).device.type
        group = self.comm.group or dist.group.WORLD  # (None: the default group)
        mesh = DeviceMesh.from_group(group, device_type)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for unit in units + [module]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=policy)
        gather = CommAllGather(self.comm)
        reduce = CommReduceScatter(self.comm, self.world_size, self.rank, kernel.prescale_gradients,
                                   kernel.gradient_predivide_factor, use_reduce_scatter=zero_config.reduce_scatter)
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_all_gather(gather)
                unit.set_custom_reduce_scatter(reduce)
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_gradient_divide_factor(1.0)  # CommReduceScatter averages
        self.units = len(units) + 1
        log_rank0(f"[dsplug-fsdp] {self.units} FSDP2 units over {self.world_size} rank(s)"
                  + (f", {param_dtype} compute with fp32 master shards" if param_dtype is not None else ""))

    # ------------------------------------------------------------------ backward and step
    def before_backward(self, is_boundary: bool) -> None:
        """Gradients are reduce-scattered at every micro-step (FSDP2 accumulates the shards)."""

    def after_backward(self) -> None:
        """FSDP2's post-backward callback has reduced every unit by the time backward returns."""

    def _attach_grads(self) -> List[torch.Tensor]:
        """Give every trained local tensor its fp32 gradient rows; returns them."""
        grads, unused = [], []
        with torch.no_grad():
            for name in self.trained:
                grad = self.params[name].grad
                local = self.local[name]
                if grad is None:
                    local.grad = None
                    unused.append(name)
                    continue
                rows = grad.to_local()
                local.grad = rows
                grads.append(rows)
        if unused and not self.ignore_unused:
            raise RuntimeError(f"ZeRO stage {STAGE_NAME!r}: parameters without gradient in this step: {unused} "
                               "(zero_optimization.ignore_unused_parameters is false)")
        return grads

    def _global_norm(self, grads: List[torch.Tensor]) -> float:
        # summed in fp64, as dsplug's ZeRO stage 3 and DeepSpeed's do: under bf16 the norm's last
        # bit decides the clip coefficient, and with it which way a weight rounds a few steps later
        squares = torch.zeros((), dtype=torch.float64, device=self._device())
        for g in grads:
            squares += torch.linalg.vector_norm(g, 2, dtype=torch.float64) ** 2
        if self.world_size > 1:
            self.comm.all_reduce(squares)
        return float(squares.sqrt())

    def _device(self):
        first = next(iter(self.local.values()), None)
        return first.device if first is not None else torch.device("cpu")

    def step(self) -> bool:
        if self.optimizer is None:
            raise RuntimeError(f"ZeRO stage {STAGE_NAME!r}: step() without an optimizer")
        grads = self._attach_grads()
        self.precision.unscale_(grads)
        norm = self._global_norm(grads)
        self.last_grad_norm = norm
        overflow = bool(self.precision.checks_overflow) and not math.isfinite(norm)
        self.precision.update_scale(overflow)
        if overflow:
            self.zero_grad()
            return False
        if self.clip > 0 and norm > self.clip and grads:
            torch._foreach_mul_(grads, self.clip / (norm + 1e-6))
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        for local in self.local.values():
            local.grad = None

    # ------------------------------------------------------------------ full values
    def _full(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.comm, rows, self.params[name].shape, self.world_size)

    def _name(self, param) -> Optional[str]:
        """The name of one of the module's parameters (None for anything else)."""
        name = self.name_of_param.get(id(param))
        return name if name is not None and self.params[name] is param else None

    def _trained_name(self, param) -> Optional[str]:
        """The name of ``param`` when this stage's optimizer trains it, else None."""
        name = self._name(param)
        return name if name in self.trained_set else None

    def module_state_dict(self) -> Dict[str, Any]:
        """The full module state dict (parameters in the training dtype): one all-gather per
        parameter through ``context.comm``; every rank calls it."""
        from torch.distributed.tensor import DTensor

        out: Dict[str, Any] = {}
        gathered: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, value in self.module.state_dict(keep_vars=True).items():
                if isinstance(value, DTensor):
                    name = key if key in self.params else self._name(value)
                    if name not in gathered:
                        gathered[name] = self._full(name, self.local[name].detach()).to(self.model_dtype)
                    out[key] = gathered[name]
                else:
                    out[key] = value.detach()
        return out

    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.tensor import DTensor

        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys "
                               f"{missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for key, value in own.items():
                if key not in state:
                    continue
                source = state[key]
                if tuple(source.shape) != tuple(value.shape):
                    raise RuntimeError(f"loading state_dict: {key!r} has shape {tuple(source.shape)} in the "
                                       f"checkpoint, {tuple(value.shape)} in the model")
                if isinstance(value, DTensor):
                    name = key if key in self.params else self._name(value)
                    start, length = self.rows[name]
                    self.local[name].copy_(source.narrow(0, start, length))
                else:
                    value.copy_(source)

    def gathered(self, params, modifier_rank: Optional[int] = None):
        """The contract's gather (``dsplug.zero.GatheredParameters``): inside the block the module
        holds a full Parameter (training dtype) where each of ``params`` was; see the module
        docstring. None when none of ``params`` is this model's."""
        names = [n for n in dict.fromkeys(self._name(p) for p in params) if n is not None]
        if not names:
            return None
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < self.world_size):
            raise ValueError(f"GatheredParameters: modifier_rank={modifier_rank!r} is not a rank of the data-parallel "
                             f"group (0..{self.world_size - 1}), nor None")
        return _Gathered(self, names, modifier_rank)

    def refresh_master_from_model(self) -> None:
        """The sharded parameters are the masters: a module load already wrote them."""

    def full_fp32_param(self, param) -> Optional[torch.Tensor]:
        name = self._trained_name(param)
        if name is None:
            return None
        return self._full(name, self.local[name].detach().float())

    def set_full_fp32_param(self, param, value) -> None:
        name = self._name(param)
        if name is None:
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: not a parameter of the model this stage trains")
        start, length = self.rows[name]
        with torch.no_grad():
            self.local[name].copy_(value.reshape(self.params[name].shape).narrow(0, start, length))

    def full_grad(self, param) -> Optional[torch.Tensor]:
        name = self._trained_name(param)
        if name is None or self.params[name].grad is None:
            return None
        with torch.no_grad():
            return self._full(name, self.params[name].grad.to_local().float())

    def full_optimizer_state(self, param, key: str):
        name = self._trained_name(param)
        if name is None or self.optimizer is None:
            return None
        value = self.optimizer.state.get(self.local[name], {}).get(key)
        if value is None:
            return None
        if ckpt.is_row_wise(value, self.rows[name][1], self.params[name].shape):
            return self._full(name, value.detach())
        return value

    def set_full_optimizer_state(self, param, key: str, value) -> None:
        name = self._trained_name(param)
        if name is None or self.optimizer is None:
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: not a parameter this stage's optimizer trains")
        mine = self.optimizer.state[self.local[name]].get(key)
        start, length = self.rows[name]
        if mine is None:
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: the optimizer has no state {key!r} for {name!r} yet")
        with torch.no_grad():
            mine.copy_(value.reshape(self.params[name].shape).narrow(0, start, length))

    def memory_breakdown(self) -> Dict[str, int]:
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        params = nbytes(self.local.values())
        grads = nbytes(p.grad.to_local() for p in self.params.values() if p.grad is not None)
        states = 0
        if self.optimizer is not None:
            states = nbytes(v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        return {"parameters": params, "gradients": grads, "optimizer_states": states, "buffers": 0,
                "total": params + grads + states}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "format": ckpt.FORMAT, "version": ckpt.VERSION, "world_size": self.world_size, "rank": self.rank,
            "params": {n: {"shape": list(p.shape), "rows": list(self.rows[n])} for n, p in self.params.items()},
            "groups": [], "state": {}}
        if self.master_weights:
            state["master"] = {n: self.local[n].detach() for n in self.trained}
        if self.optimizer is not None:
            saved = self.optimizer.state_dict()
            order = [self.name_of_local[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
            state["groups"] = [{"names": [self.name_of_local[id(p)] for p in g["params"]],
                                "hyper": {k: v for k, v in s.items() if k != "params"}}
                               for g, s in zip(self.optimizer.param_groups, saved["param_groups"])]
            state["state"] = {order[i]: entries for i, entries in saved["state"].items()}
        return state

    def load_state_dict(self, state: Dict[str, Any], load_optimizer_states: bool = True,
                        saved_world_size: Optional[int] = None,
                        read_rank: Optional[Callable[[int], Dict[str, Any]]] = None) -> None:
        ckpt.check_format(state)
        layout = {n: {"shape": list(p.shape), "rows": list(self.rows[n])} for n, p in self.params.items()}
        if state["world_size"] != self.world_size:
            if read_rank is None:
                raise ckpt.Fsdp2CheckpointError(f"this checkpoint was saved by {state['world_size']} ranks, this run "
                                                f"has {self.world_size}, and no other rank's state can be read")
            state = ckpt.reslice(read_rank, state["world_size"], self.world_size, self.rank)
        if {n: (list(v["shape"]), list(v["rows"])) for n, v in state["params"].items()} != \
                {n: (v["shape"], v["rows"]) for n, v in layout.items()}:
            theirs, mine = set(state["params"]), set(layout)
            raise ckpt.Fsdp2CheckpointError(
                f"the checkpoint's parameters do not match this model's (only in the checkpoint: "
                f"{sorted(theirs - mine)}, only in the model: {sorted(mine - theirs)}, or different shapes)")
        with torch.no_grad():
            if self.master_weights and self.load_from_fp32 and "master" in state:
                for name, rows in state["master"].items():
                    self.local[name].copy_(rows)
        if load_optimizer_states and self.optimizer is not None:
            self._load_optimizer(state)

    def _load_optimizer(self, state: Dict[str, Any]) -> None:
        groups = self.optimizer.param_groups
        saved = state["groups"]
        mine = [[self.name_of_local[id(p)] for p in g["params"]] for g in groups]
        if [g["names"] for g in saved] != mine:
            raise ckpt.Fsdp2CheckpointError(
                f"the checkpoint's optimizer groups {[g['names'] for g in saved]} are not this optimizer's {mine}; "
                "load with load_optimizer_states=False to keep the weights only")
        index = {name: i for i, name in enumerate(n for names in mine for n in names)}
        self.optimizer.load_state_dict({
            "state": {index[name]: entries for name, entries in state["state"].items()},
            "param_groups": [{**g["hyper"], "params": [index[n] for n in g["names"]]} for g in saved]})


class _Gathered:
    """Full Parameters in the module in place of the DTensor parameters ``names`` (every slot a
    tied parameter has), for one ``with`` block."""

    def __init__(self, stage: Fsdp2Stage, names: List[str], modifier_rank: Optional[int]):
        self.stage, self.names, self.modifier_rank = stage, names, modifier_rank
        wanted = {id(stage.params[n]): n for n in names}
        self.slots: Dict[str, list] = {n: [] for n in names}
        for owner in stage.module.modules():
            for leaf, p in owner._parameters.items():
                if p is not None and id(p) in wanted:
                    self.slots[wanted[id(p)]].append((owner, leaf))
        self.full: Dict[str, torch.nn.Parameter] = {}

    def _put(self, value_of) -> None:
        for name, slots in self.slots.items():
            for owner, leaf in slots:
                owner._parameters[leaf] = value_of(name)

    def __enter__(self):
        stage = self.stage
        with torch.no_grad():
            for name in self.names:
                full = stage._full(name, stage.local[name].detach()).to(stage.model_dtype)
                self.full[name] = torch.nn.Parameter(full, requires_grad=stage.params[name].requires_grad)
        self._put(self.full.__getitem__)
        return self

    def __exit__(self, *exc_info):
        stage = self.stage
        try:
            if self.modifier_rank is not None and exc_info[0] is None:
                with torch.no_grad():
                    for name in self.names:
                        full = self.full[name].detach()
                        stage.comm.broadcast(full, src=self.modifier_rank)
                        start, length = stage.rows[name]
                        stage.local[name].copy_(full.narrow(0, start, length))
        finally:
            self._put(stage.params.__getitem__)
            self.full.clear()
        return False


# ------------------------------------------------------------------ helpers
def _check_torch(module) -> None:
    """What FSDP2 needs here: a process group, custom collectives, parameters with rows."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized():
        raise RuntimeError(f"ZeRO stage {STAGE_NAME!r} needs torch.distributed (FSDP2 builds a device mesh over "
                           "the data-parallel group); initialize without dist_init_required=False")
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                   "set_gradient_divide_factor"):
        if not hasattr(FSDPModule, method):
            raise RuntimeError(f"ZeRO stage {STAGE_NAME!r} needs FSDPModule.{method} (FSDP2 with custom "
                               f"collectives); torch {torch.__version__} has none: upgrade torch")
    if not any(True for _ in module.parameters()):
        raise ValueError(f"ZeRO stage {STAGE_NAME!r}: the model has no parameters to shard")
    for name, p in module.named_parameters():
        if p.dim() == 0:
            raise ValueError(f"ZeRO stage {STAGE_NAME!r}: parameter {name!r} is a 0-dimensional tensor; FSDP2 "
                             "shards parameters by rows (reshape it to shape [1])")


def units_to_shard(module: torch.nn.Module, wrap: List[str]) -> List[torch.nn.Module]:
    """The submodules sharded as units of their own, innermost first (FSDP2 wants a unit's
    submodule units sharded before it). ``wrap``: class names (``fsdp2.wrap``); empty: the
    entries of the outermost ``nn.ModuleList``s, else the children of an ``nn.Sequential`` root."""
    def has_params(m):
        return any(True for _ in m.parameters())

    if wrap:
        wanted = set(wrap)
        units = [m for m in module.modules() if m is not module and type(m).__name__ in wanted and has_params(m)]
        found = {type(m).__name__ for m in units}
        unknown = sorted(wanted - found)
        if unknown:
            classes = sorted({type(m).__name__ for m in module.modules() if m is not module and has_params(m)})
            raise ConfigError(Issue("zero_optimization.wrap", f"no submodule with parameters is of class {unknown}; the "
                                                       f"model's classes with parameters: {classes}"))
        return list(reversed(units))

    units: List[torch.nn.Module] = []

    def visit(m):
        for child in m.children():
            if isinstance(child, torch.nn.ModuleList):
                units.extend(c for c in child if has_params(c))
            else:
                visit(child)

    visit(module)
    if not units and isinstance(module, torch.nn.Sequential):
        units = [c for c in module.children() if has_params(c)]
    return units


def _dtypes(precision, context):
    """``(model dtype, FSDP2 param_dtype, FSDP2 reduce_dtype)`` for ``precision``; refuses what
    this stage does not train with a ConfigError naming the precision's section."""
    model = precision.model_dtype or torch.float32
    where = _precision_section(context)
    if model == torch.float32:
        if precision.master_weights:
            raise ConfigError(Issue(where, f"precision {getattr(precision, 'name', '?')!r} keeps master weights of an "
                                           f"fp32 model; the ZeRO stage {STAGE_NAME!r} trains fp32, or bf16 / fp16 "
                                           "with fp32 master weights"))
        param_dtype = None
    elif model in (torch.bfloat16, torch.float16):
        if not precision.master_weights:
            raise ConfigError(Issue(where, f"precision {getattr(precision, 'name', '?')!r} trains {model} weights "
                                           f"without fp32 master weights; the ZeRO stage {STAGE_NAME!r} keeps fp32 "
                                           "master shards (use the bf16 or fp16 section)"))
        param_dtype = model
    else:
        raise ConfigError(Issue(where, f"the ZeRO stage {STAGE_NAME!r} trains fp32, bf16 or fp16, not {model}"))
    kernel = context.config.kernel
    if kernel.fp32_allreduce:
        reduce = torch.float32
    elif kernel.communication_data_type:
        reduce = _DTYPES[kernel.communication_data_type.lower()]
    else:
        reduce = precision.grad_accum_dtype or model
    # reduce_dtype None: FSDP2 reduces in the dtype the gradients are computed in (the compute dtype)
    compute = param_dtype or torch.float32
    return model, param_dtype, (None if reduce == compute else reduce)


def _precision_section(context) -> str:
    try:
        provided, _ = context.config.selection("precision")
        return provided.spec.section or f"precision {provided.name!r}"
    except Exception:  # noqa: BLE001 - only for the message
        return "precision"


def _refuse_expert_parameters(module) -> None:
    experts = [n for n, p in module.named_parameters() if getattr(p, "allreduce", True) is False
               or getattr(p, "group_name", None) is not None]
    if experts:
        raise ValueError(f"ZeRO stage {STAGE_NAME!r} does not train MoE expert parameters (marked allreduce=False / "
                         f"group_name: {experts[:3]}{' ...' if len(experts) > 3 else ''}); use ZeRO stage 0, 1 or 2")
