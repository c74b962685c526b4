"""DeepSpeed's checkpoint layout, read and written by the ZeRO stages (checkpoint interchange).

DeepSpeed (0.19) and dsplug name their files alike (``mp_rank_00_model_states.pt``,
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, ``latest``) but keep other keys in them. This
module knows DeepSpeed's keys, so a run can switch engines in either direction mid-training:

* **reading** (:func:`load`, :class:`DeepSpeedCheckpoint`): a checkpoint without dsplug's keys is
  translated into dsplug's own state: the module, the counters and LR scheduler in the shared
  ``checkpoint.model``, and each rank's ZeRO state in the partitioned format of
  ``docs/zero-stages.md`` (so loading at another world size re-slices it like any dsplug checkpoint);
* **writing** (:func:`model_keys`, :func:`zero12_keys`, :func:`zero3_keys`, :func:`stage0_optimizer`,
  :func:`write_extra_files`): every dsplug save also carries what DeepSpeed's ``load_checkpoint``
  reads. The tensors are the very objects of dsplug's own state (``torch.save`` stores a shared
  storage once), so this costs a few small dicts; only the files DeepSpeed names differently are
  extra: for bf16 at stages 1-3 DeepSpeed reads ``bf16_zero_pp_rank_*`` (symbolic links to dsplug's
  rank files here), and at stage 3 each rank's ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (counters and metadata, no weights).

DeepSpeed pickles a few objects of its own classes into its files (the loss scaler, the ZeRO stage
enum, fragment addresses). :func:`register_safe_globals` lets ``torch.load(weights_only=True)``
read them as plain records (:class:`LossScaler` ...) without DeepSpeed installed; the records
pickle back under DeepSpeed's names, which DeepSpeed's own loader (``weights_only=False``) resolves
to its real classes.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import types
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch

from dsplug import checkpoint as ckpt
from dsplug import hookimpl
from dsplug.logging import log_rank0

from .layout import contiguous_partition_numel, merge_partitions

#: the DeepSpeed version whose layout is written (DeepSpeed checks ``ds_version`` is set, >= 0.3.17)
DS_VERSION = "0.19.8"
MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"

log = logging.getLogger(__name__)


def zero_model_file(rank: int) -> str:
    """DeepSpeed's per-rank model file at ZeRO stage 3."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(rank: int, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def aligned_partition_numel(numel: int, world_size: int) -> int:
    """Elements per rank of a ZeRO-1/2 param group of ``numel`` elements, as DeepSpeed partitions it
    (and dsplug's contiguous layout, :func:`.layout.contiguous_partition_numel`)."""
    return contiguous_partition_numel(numel, world_size)


# ============================================================================== DeepSpeed's classes
class _Record:
    """An object of one of DeepSpeed's classes, as plain attributes (``__dict__``).

    Pickled as ``<DeepSpeed's class>(*_ds_args)`` followed by its attributes: DeepSpeed's loader
    builds its real object, dsplug's (``weights_only=True``) this record again."""

    #: which attributes are the positional arguments of DeepSpeed's constructor
    _ds_args: tuple = ()

    def __init__(self, *args, **state):
        self.__dict__.update(state)

    def __eq__(self, other):
        return isinstance(other, _Record) and type(other).__qualname__ == type(self).__qualname__ \
            and other.__dict__ == self.__dict__

    def __repr__(self):
        return f"{type(self).__qualname__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"

    def __reduce_ex__(self, protocol):
        return (_pickled_class(type(self)), tuple(self.__dict__.get(k) for k in self._ds_args), dict(self.__dict__))


def _record_class(module: str, name: str, args: tuple) -> type:
    return type(name, (_Record,), {"__module__": module, "__qualname__": name, "_ds_args": args,
                                   "__doc__": f"DeepSpeed's ``{module}.{name}`` as a plain record."})


LossScaler = _record_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler", ("cur_scale",))
DynamicLossScaler = _record_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler",
                                  ("cur_scale", "scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis"))
FragmentAddress = _record_class("deepspeed.utils.tensor_fragment", "fragment_address", ("numel", "start"))


def _zero_stage_enum(value):
    """DeepSpeed's ``ZeroStageEnum(value)``, read as the int it is."""
    return int(value)


_zero_stage_enum.__module__, _zero_stage_enum.__qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"
_RECORDS = (LossScaler, DynamicLossScaler, FragmentAddress)


class _StubModule(types.ModuleType):
    """Stands for DeepSpeed's module (and its top package) in ``sys.modules`` for the moment pickle
    looks a record's class up; ``sys.modules`` is put back as it was as soon as the class is found."""

    def __init__(self, name: str, saved: Dict[str, Any], attr: str = "", found: Any = None):
        super().__init__(name, "dsplug's stand-in for a DeepSpeed module while pickling (checkpoint interchange)")
        self._saved, self._attr, self._found = saved, attr, found

    def __getattr__(self, attr):
        if attr != self._attr or self._found is None:
            raise AttributeError(attr)
        _restore(self._saved)
        return self._found


def _restore(saved: Dict[str, Any]) -> None:
    for name, previous in saved.items():
        if isinstance(sys.modules.get(name), _StubModule):
            if previous is None:
                del sys.modules[name]
            else:
                sys.modules[name] = previous


def _pickled_class(cls: type) -> type:
    """The class pickle saves for a record of ``cls``: DeepSpeed's own class when DeepSpeed is
    imported in this process, else a fresh subclass named like DeepSpeed's, found as
    ``<DeepSpeed's module>.<name>`` for that one lookup. pickle imports the module (and so its top
    package) first: both are stubbed for that moment and ``sys.modules`` is restored right after
    (a lasting ``deepspeed`` there would tell other libraries DeepSpeed is installed; dsplug's own
    ``deepspeed`` alias, when enabled, is put back). A fresh class each time: pickle memoizes a
    class it has saved and would not look it up again."""
    module_name, name = cls.__module__, cls.__qualname__
    existing = sys.modules.get(module_name)
    if existing is not None and not isinstance(existing, _StubModule):
        real = getattr(existing, name, None)
        if isinstance(real, type) and real.__module__ == module_name and real.__qualname__ == name:
            return real
    fresh = type(name, (cls,), {"__module__": module_name, "__qualname__": name})
    top = module_name.split(".")[0]
    saved = {module_name: existing}
    if top not in sys.modules:
        saved[top] = None
        sys.modules[top] = _StubModule(top, saved)
    sys.modules[module_name] = _StubModule(module_name, saved, name, fresh)
    return fresh


_registered = False


def register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` read DeepSpeed's pickled objects as records, without
    DeepSpeed. (``weights_only=False`` imports DeepSpeed's real classes, so it needs DeepSpeed.)"""
    global _registered
    if _registered:
        return
    _registered = True
    torch.serialization.add_safe_globals(
        [*_RECORDS, (_zero_stage_enum, "deepspeed.runtime.zero.config.ZeroStageEnum")])


def _attrs(obj) -> Dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    return dict(getattr(obj, "__dict__", {}))


# ============================================================================== loss scaler
def loss_scaler_object(precision):
    """DeepSpeed's loss scaler for dsplug's precision (a static 1.0 one without loss scaling)."""
    scaler = getattr(precision, "loss_scaler", None)
    if scaler is None:
        return LossScaler(cur_scale=1.0, dynamic=False)
    if not getattr(scaler, "dynamic", False):
        return LossScaler(cur_scale=float(scaler.scale), dynamic=False)
    return DynamicLossScaler(
        cur_scale=float(scaler.scale), dynamic=True, cur_iter=int(scaler.iteration),
        last_overflow_iter=int(scaler.last_overflow_iteration), scale_factor=float(scaler.scale_factor),
        scale_window=int(scaler.scale_window), min_scale=float(scaler.min_scale), delayed_shift=int(scaler.hysteresis),
        cur_hysteresis=int(scaler.remaining_hysteresis), consecutive_hysteresis=bool(scaler.consecutive_hysteresis),
        raise_error_at_min_scale=True, dtype=torch.float16)


def precision_state(loss_scaler) -> Optional[dict]:
    """dsplug's precision state (``{"loss_scaler": ...}``) from DeepSpeed's loss scaler; None when
    there is nothing to restore (a static scaler)."""
    state = _attrs(loss_scaler)
    if not state.get("dynamic"):
        return None
    return {"loss_scaler": {"scale": float(state["cur_scale"]),
                            "remaining_hysteresis": int(state.get("cur_hysteresis", state.get("delayed_shift", 1))),
                            "iteration": int(state.get("cur_iter", 0)),
                            "last_overflow_iteration": int(state.get("last_overflow_iter", -1))}}


# ============================================================================== writing
def _frozen(module) -> "OrderedDict[str, torch.Size]":
    return OrderedDict((n, torch.Size(getattr(p, "ds_shape", p.shape))) for n, p in module.named_parameters()
                       if not p.requires_grad)


def _frozen_fragments(module) -> "OrderedDict[str, torch.Tensor]":
    """Frozen parameters' values (at stage 3 this rank's partition of each, as DeepSpeed saves them)."""
    return OrderedDict((n, getattr(p, "ds_tensor", p).detach()) for n, p in module.named_parameters()
                       if not p.requires_grad)


def model_keys(stage, *, param_shapes, world_size: int, optimizer=None, module=None) -> Dict[str, Any]:
    """DeepSpeed's keys of the model-states file that dsplug does not write itself (dsplug's
    ``module``, ``lr_scheduler``, ``global_steps``, ``global_samples`` and ``skipped_steps`` are
    DeepSpeed's too). ``param_shapes``: per param group, name -> shape in flattening order (None
    at stage 0); ``optimizer``: stage 0's optimizer state in DeepSpeed's form."""
    mod = module if module is not None else stage.module
    keys = {
        "buffer_names": [n for n, _ in mod.named_buffers()],
        "optimizer": optimizer,
        "param_shapes": param_shapes,
        # (DeepSpeed keeps frozen parameters apart when it partitions gradients: stages 2 and 3)
        "frozen_param_shapes": _frozen(mod) if stage.stage >= 2 else None,
        "shared_params": {} if param_shapes is not None else None,
        "frozen_param_fragments": _frozen_fragments(mod) if stage.stage >= 2 else None,
        "data_sampler": None,
        "random_ltd": None,
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": DS_VERSION,
    }
    return keys


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def stage0_state(saved) -> dict:
    """dsplug's stage-0 ``state_dict()`` from DeepSpeed's ``optimizer`` entry of the model file:
    a torch optimizer's state dict, or FP16(_Unfused)_Optimizer's wrapper with fp32 master weights."""
    if isinstance(saved, dict) and OPTIMIZER_STATE_DICT in saved:
        state = {"optimizer": saved[OPTIMIZER_STATE_DICT]}
        groups = saved.get("fp32_groups")
        if groups is not None and all(isinstance(g, (list, tuple)) for g in groups):
            state["master_weights"] = [t for g in groups for t in g]
        return state
    return {"optimizer": saved}


def stage0_optimizer(stage, iteration: int):
    """Stage 0's optimizer state as DeepSpeed keeps it in the model file: the torch optimizer's
    state dict (fp32), wrapped like DeepSpeed's FP16_UnfusedOptimizer with the fp32 master weights
    (bf16 / fp16)."""
    state = stage.optimizer.state_dict()
    if not stage.master:
        return state
    scaler = loss_scaler_object(stage.precision)
    out = {"dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)), "cur_scale": float(scaler.cur_scale),
           "cur_iter": int(getattr(scaler, "cur_iter", iteration))}
    if out["dynamic_loss_scale"]:
        out.update(last_overflow_iter=scaler.last_overflow_iter, scale_factor=scaler.scale_factor,
                   scale_window=scaler.scale_window)
    out[OPTIMIZER_STATE_DICT] = state
    out["fp32_groups"] = [list(group["params"]) for group in stage.optimizer.param_groups]  # the masters
    return out


def _common_rank_keys(stage_number: int, precision, world_size: int, records: bool) -> dict:
    keys = {"zero_stage": stage_number, "loss_scaler": loss_scaler_object(precision),
            "dynamic_loss_scale": bool(getattr(getattr(precision, "loss_scaler", None), "dynamic", False)),
            "overflow": False, "partition_count": world_size}
    if not records:
        del keys["loss_scaler"]
    return keys


_warned_records = False


def records_allowed(stage) -> bool:
    """DeepSpeed's pickled objects (the loss scaler, fragment addresses) go into dsplug's own rank
    files only when they load with ``weights_only=True`` (the default): ``torch.load`` with
    ``weights_only=False`` would import DeepSpeed for them. Without them DeepSpeed still loads
    stages 0-2 (it keeps its own loss scaler), not stage 3 (logged once)."""
    global _warned_records
    allowed = _weights_only(stage)
    if not allowed and stage.stage == 3 and not _warned_records:
        _warned_records = True
        log_rank0("note: checkpoint.weights_only=false: the ZeRO-3 checkpoint leaves out DeepSpeed's loss scaler "
                  "object, so DeepSpeed cannot resume it (dsplug can)", logging.WARNING)
    return allowed


def zero12_keys(state: dict, precision, clip: float, optimizer_param_groups, records: bool = True) -> Dict[str, Any]:
    """DeepSpeed's ``optimizer_state_dict`` of a ZeRO-1/2 rank, built on dsplug's ``state_dict()``
    (the ``contiguous`` layout with DeepSpeed's partition size: the same tensors)."""
    world, rank = int(state["world_size"]), int(state["rank"])
    base_state, base_groups, fp32_groups, paddings, mappings = {}, [], [], [], []
    for gi, group in enumerate(state["groups"]):
        partition = int(group["partition_numel"])
        numel = int(group["numel"])
        padding = max(0, min(partition, (rank + 1) * partition - numel))
        base_state[gi] = dict(group["state"])
        base_groups.append({**_hyper(optimizer_param_groups[gi]), "params": [gi]})
        fp32_groups.append(group["fp32"][:partition - padding])
        paddings.append(padding)
        mappings.append(_slice_mappings(group, rank, partition))
    keys = _common_rank_keys(int(state["zero_stage"]), precision, world, records)
    keys.update({
        "clip_grad": float(clip),
        "base_optimizer_state": {"state": base_state, "param_groups": base_groups},
        "single_partition_of_fp32_groups": fp32_groups,
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(g["names"]) for g in state["groups"]],
        "partition_count": [world] * len(state["groups"]),
        "ds_version": DS_VERSION,
        "param_slice_mappings": mappings,
    })
    if not records:
        del keys["param_slice_mappings"]
    return {OPTIMIZER_STATE_DICT: keys}


def _slice_mappings(group: dict, rank: int, partition: int) -> "OrderedDict[str, Any]":
    lo, hi = rank * partition, (rank + 1) * partition
    out, offset = OrderedDict(), 0
    for name, shape in zip(group["names"], group["shapes"]):
        n = math.prod(shape)
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            out[name] = FragmentAddress(numel=stop - start, start=start - lo)
        offset += n
    return out


def zero3_keys(state: dict, precision, optimizer_param_groups, sub_group_size: Optional[int],
               records: bool = True) -> Dict[str, Any]:
    """DeepSpeed's ``optimizer_state_dict`` of a ZeRO-3 rank, built on dsplug's ``state_dict()``
    (the ``per_param`` layout is DeepSpeed's): one flat fp32 partition per sub-group."""
    world = int(state["world_size"])
    flats, opt_state, groups = [], {}, []
    for gi, group in enumerate(state["groups"]):
        ids = []
        sizes = [math.ceil(math.prod(s) / world) for s in group["shapes"]]
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        for members in sub_groups(sizes, sub_group_size):
            lo, hi = (starts[members[0]], starts[members[-1] + 1]) if members else (0, 0)
            sub = len(flats)
            flats.append(group["fp32"][lo:hi])
            opt_state[sub] = {k: (v[lo:hi] if _elementwise(v, group["partition_numel"]) else v)
                              for k, v in group["state"].items()}
            ids.append(sub)
        groups.append({**_hyper(optimizer_param_groups[gi]), "params": ids})
    keys = _common_rank_keys(3, precision, world, records)
    keys.update({OPTIMIZER_STATE_DICT: {"state": opt_state, "param_groups": groups}, "fp32_flat_groups": flats})
    return {OPTIMIZER_STATE_DICT: keys}


def zero3_sub_group_shapes(names, shapes, world: int, sub_group_size: Optional[int]):
    """DeepSpeed's ``param_shapes`` of one param group at stage 3: name -> shape per sub-group."""
    sizes = [math.ceil(math.prod(s) / world) for s in shapes]
    return [OrderedDict((names[i], torch.Size(shapes[i])) for i in members)
            for members in sub_groups(sizes, sub_group_size)]


def sub_groups(sizes: List[int], sub_group_size: Optional[int]) -> List[List[int]]:
    """DeepSpeed's ZeRO-3 sub-groups of one param group (``sizes``: each parameter's partition
    elements), as lists of parameter indices: consecutive parameters until ``sub_group_size``
    elements are reached."""
    total = sum(sizes)
    if not sizes or sub_group_size is None or sub_group_size >= total:
        return [list(range(len(sizes)))]
    out, current, acc = [], [], 0
    for i, k in enumerate(sizes):
        current.append(i)
        acc += k
        if acc >= sub_group_size or i == len(sizes) - 1:
            out.append(current)
            current, acc = [], 0
    return out


def _elementwise(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def write_extra_files(options, rank: int, files: Dict[str, Any], links: Dict[str, str]) -> None:
    """The files DeepSpeed reads under other names than dsplug's, into the checkpoint being saved
    (its staging directory): ``files`` {name: object} are saved, ``links`` {name: target} are
    relative symbolic links to dsplug's files. Best effort: a failure is logged, the dsplug
    checkpoint is unaffected."""
    staging = ckpt.partial_dir(options.save_dir, options.tag) if options.save_dir else ""
    if not staging or not os.path.isdir(staging):
        return  # not a save in progress (e.g. a contract test asking for the state)
    from dsplug.comm import groups

    if groups._get_model_parallel_world_size() > 1:
        return  # DeepSpeed's names below are those of model-parallel slice 0 only: not written with an mpu
    try:
        for name, obj in files.items():
            ckpt.atomic_save(obj, os.path.join(staging, name))
        for name, target in links.items():
            path = os.path.join(staging, name)
            if os.path.lexists(path):
                os.unlink(path)
            os.symlink(target, path)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's extras never fail a dsplug save
        log.warning("rank %d: could not write DeepSpeed's files %s: %s: %s", rank, sorted({**files, **links}),
                    type(exc).__name__, exc)


SCRIPT_NAME = "zero_to_fp32.py"


def write_script(save_dir: str) -> None:
    """(rank 0) the standalone ``zero_to_fp32.py`` into ``save_dir``, executable, as DeepSpeed does."""
    from . import zero_to_fp32_script

    if not save_dir or not os.path.isdir(save_dir):
        return  # not a save in progress (e.g. a contract test asking for the state)
    try:
        with open(zero_to_fp32_script.__file__, "rb") as f:
            text = f.read()
        path = os.path.join(save_dir, SCRIPT_NAME)
        current = None
        if os.path.isfile(path):
            with open(path, "rb") as f:
                current = f.read()
        if current != text:
            ckpt.atomic_write_bytes(path, text)
        ckpt.make_executable(path)
    except OSError as exc:
        log.warning("could not write %s into %s: %s", SCRIPT_NAME, save_dir, exc)


# ============================================================================== reading
def is_native(checkpoint) -> bool:
    """The checkpoint carries dsplug's own keys (then they are read, DeepSpeed's ignored)."""
    return "dsplug_version" in checkpoint.model or "stage" in checkpoint.rank


class DeepSpeedCheckpoint:
    """A checkpoint written by DeepSpeed, read lazily from its tag directory."""

    def __init__(self, path: str, weights_only: bool = True, model: Optional[dict] = None):
        register_safe_globals()
        self.path = path
        self.weights_only = weights_only
        if model and "ds_version" in model:
            self.model = model
        elif os.path.isfile(os.path.join(path, MODEL_FILE)):
            self.model = self._load(MODEL_FILE)
        elif os.path.isfile(os.path.join(path, zero_model_file(0))):
            self.model = self._load(zero_model_file(0))
        else:
            raise ckpt.CheckpointError(
                f"{path} is neither a dsplug checkpoint nor a DeepSpeed one: it has no {MODEL_FILE} or "
                f"{zero_model_file(0)} (it holds: {', '.join(sorted(os.listdir(path))) or 'nothing'})")
        self.world_size = int(self.model.get("dp_world_size", 1))
        self._ranks: Dict[int, dict] = {}

    def _load(self, name: str):
        return ckpt.load_file(os.path.join(self.path, name), self.weights_only)

    def rank_file(self, rank: int) -> Optional[str]:
        for bf16 in (False, True):
            name = optim_file(rank, bf16)
            if os.path.isfile(os.path.join(self.path, name)):
                return name
        return None

    @property
    def zero_stage(self) -> int:
        if self.model.get("param_shapes") is None:
            return 0
        return int(self.optimizer_state(0).get("zero_stage", 0))

    def optimizer_state(self, rank: int) -> dict:
        """Rank ``rank``'s ``optimizer_state_dict`` (ZeRO stages 1-3)."""
        if rank not in self._ranks:
            name = self.rank_file(rank)
            if name is None:
                raise ckpt.CheckpointError(
                    f"{self.path}: DeepSpeed's optimizer states of rank {rank} ({optim_file(rank)} or "
                    f"{optim_file(rank, True)}) are missing; the checkpoint was saved by {self.world_size} ranks")
            self._ranks[rank] = self._load(name)[OPTIMIZER_STATE_DICT]
        return self._ranks[rank]

    # -------------------------------------------------------------- shared state
    def shared_state(self) -> Dict[str, Any]:
        """dsplug's shared keys: counters, lr_scheduler, client_state, world_size (not ``module``)."""
        known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version", "num_experts"}
        out = {k: self.model[k] for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")
               if k in self.model}
        out["client_state"] = {k: v for k, v in self.model.items() if k not in known}
        out["world_size"] = self.world_size
        return out

    # -------------------------------------------------------------- module
    def module_state(self) -> Dict[str, torch.Tensor]:
        """The full module state dict (at stage 3 rebuilt from every rank's fp32 partitions)."""
        module = self.model.get("module") or {}
        if self.zero_stage != 3:
            return module
        full = {}
        for group in self.merged_fp32_groups():
            full.update(group)
        out = OrderedDict()
        for key, value in module.items():
            out[key] = full.get(key, value)
        for key, value in full.items():
            out.setdefault(key, value)
        return out

    def merged_fp32_groups(self) -> List[Dict[str, torch.Tensor]]:

        return [g.fp32 for g in merge_partitions([self.dsplug_stage_state(r) for r in range(self.world_size)],
                                                 where=self.path)]

    # -------------------------------------------------------------- stage state
    def stage0_state(self, master_weights: bool) -> dict:
        """dsplug's stage-0 ``state_dict()`` from DeepSpeed's ``optimizer`` entry of the model file."""
        saved = self.model.get("optimizer")
        if saved is None:
            raise ckpt.CheckpointError(f"{self.path}: DeepSpeed's model file holds no optimizer state (it was saved "
                                       f"at ZeRO stage {self.zero_stage}); load it at that stage, or with "
                                       "load_module_only=True")
        return stage0_state(saved)

    def dsplug_stage_state(self, rank: int) -> dict:
        """Rank ``rank``'s state in dsplug's partitioned format (``docs/zero-stages.md``)."""
        ds = self.optimizer_state(rank)
        stage = int(ds.get("zero_stage", 0))
        shapes = self.model.get("param_shapes")
        if not shapes:
            raise ckpt.CheckpointError(f"{self.path}: DeepSpeed's model file has no param_shapes")
        if stage == 3:
            return self._zero3_state(ds, rank, shapes)
        return self._zero12_state(ds, rank, shapes, stage)

    def _zero12_state(self, ds: dict, rank: int, shapes, stage: int) -> dict:
        world = self.world_size
        base = ds["base_optimizer_state"]
        if any(any(p) for p in ds.get("param_alignment_paddings", [])):
            raise ckpt.CheckpointError(f"{self.path}: the checkpoint was saved with zero_optimization."
                                       "parameter_alignment (padding between parameters), which dsplug does not "
                                       "implement")
        groups = []
        for gi, (shape_map, fp32) in enumerate(zip(shapes, ds["single_partition_of_fp32_groups"])):
            names, sizes = list(shape_map), [torch.Size(s) for s in shape_map.values()]
            numel = sum(math.prod(s) for s in sizes)
            partition = aligned_partition_numel(numel, world)
            if isinstance(base, dict):  # rigid: the torch optimizer's state dict, one flat param per group
                flat_id = base["param_groups"][gi]["params"][0]
                opt, hyper = base["state"].get(flat_id, {}), _hyper(base["param_groups"][gi])
            else:  # elastic: per group, the state without padding
                opt, hyper = base[gi], {}
                if "base_optimizer_state_step" in ds:
                    opt = {**opt, "step": ds["base_optimizer_state_step"]}
            state = {k: (_padded(v, partition) if torch.is_tensor(v) and v.dim() == 1 else v) for k, v in opt.items()}
            groups.append({"names": names, "shapes": sizes, "numel": numel, "partition_numel": partition,
                           "fp32": _padded(fp32.float(), partition), "state": state, "hyper": hyper})
        return {"zero_stage": stage, "layout": "contiguous", "world_size": world, "rank": rank, "groups": groups}

    def _zero3_state(self, ds: dict, rank: int, shapes) -> dict:
        world = self.world_size
        inner = ds[OPTIMIZER_STATE_DICT]
        flats = ds["fp32_flat_groups"]
        groups = []
        for pg in inner["param_groups"]:
            names, sizes, fp32, states = [], [], [], []
            for sub in pg["params"]:
                names += list(shapes[sub])
                sizes += [torch.Size(s) for s in shapes[sub].values()]
                fp32.append(flats[sub].float())
                states.append(inner["state"].get(sub, {}))
            partition = sum(math.ceil(math.prod(s) / world) for s in sizes)
            flat = torch.cat(fp32) if len(fp32) != 1 else fp32[0]
            state = {}
            for key, value in (states[0] if states else {}).items():
                if torch.is_tensor(value) and value.dim() == 1:
                    parts = [s[key] for s in states]
                    state[key] = torch.cat(parts) if len(parts) != 1 else parts[0]
                else:
                    state[key] = value
            groups.append({"names": names, "shapes": sizes, "numel": sum(math.prod(s) for s in sizes),
                           "partition_numel": partition, "fp32": flat, "state": state, "hyper": _hyper(pg)})
        return {"zero_stage": 3, "layout": "per_param", "world_size": world, "rank": rank, "groups": groups}

    def loss_scaler(self, rank: int):
        if self.zero_stage == 0:
            saved = self.model.get("optimizer") or {}
            if saved.get("dynamic_loss_scale"):
                return {"dynamic": True, "cur_scale": saved["cur_scale"], "cur_iter": saved.get("cur_iter", 0),
                        "last_overflow_iter": saved.get("last_overflow_iter", -1)}
            return None
        return self.optimizer_state(min(rank, self.world_size - 1)).get("loss_scaler")


def _padded(t: torch.Tensor, numel: int) -> torch.Tensor:
    t = t.reshape(-1)
    if t.numel() == numel:
        return t
    if t.numel() > numel:
        raise ckpt.CheckpointError(f"a saved partition holds {t.numel()} elements, more than the {numel} the "
                                   "checkpoint's world size and parameter shapes allow")
    return torch.cat([t, t.new_zeros(numel - t.numel())])


def load(stage, checkpoint, load_stage_state: Callable[..., None]) -> None:
    """Restore ``stage`` (and, through ``checkpoint.model`` / ``checkpoint.rank``, the counters, the
    LR scheduler, the precision and client_state) from a DeepSpeed checkpoint.

    Called by the ZeRO stages' load hook (which runs before every other participant's) when the
    checkpoint has no dsplug keys. ``load_stage_state(state, saved_world_size, read_rank)`` is the
    stage's ``load_state_dict`` with the options applied."""
    weights_only = _weights_only(stage)
    ds = DeepSpeedCheckpoint(checkpoint.path, weights_only, model=checkpoint.model)
    options = checkpoint.options
    log_rank0(f"checkpoint: {checkpoint.path} was written by DeepSpeed {ds.model.get('ds_version', '?')} (ZeRO stage "
              f"{ds.zero_stage}, {ds.world_size} rank(s)); translating it")
    shared = ds.shared_state()
    if not options.load_module_only:  # the other participants read these after this hook
        checkpoint.model.update(shared)
        gas = _gas(stage)
        if gas and "global_steps" in shared:
            checkpoint.model.setdefault("micro_steps", int(shared["global_steps"]) * gas)
    else:
        checkpoint.model["client_state"] = shared["client_state"]
    if stage.load_module_part(ds.module_state(), options):
        return
    checkpoint.rank.clear()
    scaler = precision_state(ds.loss_scaler(stage_rank(stage)))
    if scaler is not None:
        checkpoint.rank["precision"] = scaler
    if ds.zero_stage == 0:
        if stage.stage != 0:
            raise ckpt.CheckpointError(
                f"{checkpoint.path}: DeepSpeed saved this checkpoint without ZeRO partitions (stage 0) but this "
                f"engine runs ZeRO stage {stage.stage}: load it at stage 0, or with load_module_only=True")
        load_stage_state(ds.stage0_state(bool(getattr(stage, "master", None))), 1, None)
        return
    if stage.stage == 0:
        raise ckpt.CheckpointError(
            f"{checkpoint.path}: DeepSpeed saved this checkpoint at ZeRO stage {ds.zero_stage}, but the engine runs "
            "stage 0: load it with a partitioned stage (1-3), or with load_module_only=True")
    rank = stage_rank(stage)
    own = ds.dsplug_stage_state(min(rank, ds.world_size - 1))
    load_stage_state(own, ds.world_size, ds.dsplug_stage_state)


def stage_rank(stage) -> int:
    return int(getattr(stage, "rank", None) or getattr(getattr(stage, "context", None), "rank", 0) or 0)


def _weights_only(stage) -> bool:
    config = getattr(getattr(stage, "context", None), "config", None)
    section = getattr(config, "checkpoint", None)
    return bool(getattr(section, "weights_only", True))


def _gas(stage) -> int:
    config = getattr(getattr(stage, "context", None), "config", None)
    try:
        return int(config.kernel.gradient_accumulation_steps)
    except (AttributeError, TypeError, ValueError):
        return 0


register_safe_globals()


# ============================================================================== the stages' hooks
def is_deepspeed(checkpoint) -> bool:
    """The checkpoint was written by DeepSpeed (it has none of dsplug's keys)."""
    if is_native(checkpoint):
        return False
    return "ds_version" in checkpoint.model or (
        not checkpoint.model and os.path.isfile(os.path.join(checkpoint.path, zero_model_file(0))))


def _config_dict(stage) -> Optional[dict]:
    config = getattr(getattr(stage, "context", None), "config", None)
    try:
        return config.to_dict()
    except Exception:  # noqa: BLE001 - only informative
        return None


class DeepSpeedInterchange:
    """Mixed into the ZeRO stages (before :class:`dsplug.contracts.ZeroStage`): the checkpoint
    hooks of the contract, writing DeepSpeed's keys next to dsplug's and reading DeepSpeed's
    checkpoints. A stage provides :meth:`_ds_model_keys` and :meth:`_ds_rank_keys`."""

    def _ds_model_keys(self, engine) -> Dict[str, Any]:
        raise NotImplementedError

    def _ds_rank_keys(self, engine, state: dict, options) -> Dict[str, Any]:
        raise NotImplementedError

    def _ds_rank_state(self) -> dict:
        """What this rank's file holds under ``"stage"``."""
        return self.state_dict()

    @hookimpl
    def dsplug_checkpoint_state(self, engine, scope, options):
        if scope == "rank":
            state = self._ds_rank_state()
            return {"stage": state, **self._ds_rank_keys(engine, state, options)}
        module = self.module_state_dict()  # every rank calls it: a collective when partitioned
        if options.exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            module = {k: v for k, v in module.items() if k not in frozen}
        if stage_rank(self) == 0 and self.stage > 0:
            write_script(options.save_dir)
        return {"module": module, **self._ds_model_keys(engine)}

    @hookimpl(tryfirst=True)
    def dsplug_load_checkpoint_state(self, checkpoint):
        if not is_deepspeed(checkpoint):
            return self._load_native(checkpoint)
        options = checkpoint.options

        def load_stage_state(state, saved_world_size, read_rank):
            self.load_state_dict(state, load_optimizer_states=options.load_optimizer_states,
                                 saved_world_size=saved_world_size, read_rank=read_rank)

        load(self, checkpoint, load_stage_state)

    def _load_native(self, checkpoint):
        from dsplug.contracts import ZeroStage

        return ZeroStage.dsplug_load_checkpoint_state(self, checkpoint)

