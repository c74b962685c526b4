"""DeepSpeed's ``deepspeed.utils.groups``: the process groups a training script (and Hugging Face
Transformers / Accelerate, MoE layers, ZeRO stages) asks about.

Data parallelism: without a model-parallel unit the data-parallel group is the world. With one
(``dsplug.initialize(mpu=...)``, :func:`set_mpu`), the data-parallel, model-parallel and tensor-
parallel answers are the mpu's.

Expert parallelism (MoE, DeepSpeed's layout): :func:`_create_expert_and_data_parallel` splits
every data-parallel group of D ranks into expert-parallel groups of E consecutive data-parallel
ranks (the ranks that hold different experts of one layer and exchange tokens by all-to-all) and
expert-data-parallel groups of the D/E ranks at the same position in their block (the ranks that
hold the same experts and average their gradients). The groups are named ``"ep_size_<E>"``.
With ``use_data_before_expert_parallel_`` the roles swap: expert-data-parallel groups are the
consecutive blocks of D/E ranks and expert-parallel groups are strided.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import comm


#: the model-parallel unit given to ``initialize(mpu=...)`` / :func:`set_mpu` (None: data parallel only)
_mpu = None
#: "ep_size_<E>" -> (expert-parallel group, its global ranks), (expert-data-parallel group, its ranks)
_expert_parallel: Dict[str, Tuple[object, List[int]]] = {}
_expert_data_parallel: Dict[str, Tuple[object, List[int]]] = {}

MPU_METHODS = ("get_model_parallel_rank", "get_model_parallel_group", "get_model_parallel_world_size",
               "get_data_parallel_rank", "get_data_parallel_group", "get_data_parallel_world_size")


def _world_group():
    if not comm.is_initialized():
        return None
    import torch.distributed as dist

    return dist.group.WORLD


def set_mpu(mpu) -> None:
    """Use ``mpu`` (an object with DeepSpeed's six ``get_{model,data}_parallel_{rank,group,world_size}``
    methods) for the data- and model-parallel answers; None returns to plain data parallelism.
    A missing method is a ``TypeError`` naming it."""
    global _mpu
    if mpu is not None:
        missing = [m for m in MPU_METHODS if not callable(getattr(mpu, m, None))]
        if missing:
            raise TypeError(f"mpu={type(mpu).__name__}: a model-parallel unit needs the methods "
                            f"{', '.join(MPU_METHODS)}; missing: {', '.join(missing)}")
    _mpu = mpu


def get_mpu():
    return _mpu


def group_ranks(group) -> List[int]:
    """The global ranks of ``group`` in group-rank order (the world's for None / WORLD)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(comm.get_world_size()))
    return list(dist.get_process_group_ranks(group))


# ------------------------------------------------------------------ data parallel
def _get_data_parallel_group():
    """The data-parallel process group: the mpu's, else the world (None before init_distributed)."""
    if _mpu is not None:
        return _mpu.get_data_parallel_group()
    return _world_group()


def _get_data_parallel_world_size() -> int:
    if _mpu is not None:
        return int(_mpu.get_data_parallel_world_size())
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    if _mpu is not None:
        return int(_mpu.get_data_parallel_rank())
    return comm.get_rank()


def _get_broadcast_src_rank() -> int:
    """The global rank that broadcasts to this rank's data-parallel group (its first rank)."""
    if _mpu is None or not comm.is_initialized():
        return 0
    return group_ranks(_get_data_parallel_group())[0]


def _clone_world_group():
    return _world_group()


def _get_world_group():
    return _world_group()


def _get_world_size() -> int:
    return comm.get_world_size()


def _get_zero_param_intra_parallel_group():
    """DeepSpeed's global for ZeRO++'s hpZ group: dsplug keeps that group inside its ZeRO-3 stage
    (``zero_hpz_partition_size``), not here, so this reports none (size 1)."""
    return None


def _get_zero_param_intra_parallel_group_world_size() -> int:
    return 1


def _get_zero_param_intra_parallel_rank_in_mygroup() -> int:
    return 0


def data_parallel_comm():
    """The comm layer bound to this rank's data-parallel group: :mod:`dsplug.comm` itself without an
    mpu (or when the group is the world), else a :class:`dsplug.comm.bound.GroupComm`."""
    if _mpu is None or not comm.is_initialized():
        return comm
    from ..comm.bound import GroupComm

    group = _get_data_parallel_group()
    ranks = group_ranks(group)
    if len(ranks) == comm.get_world_size():
        return comm
    return GroupComm(comm, group, ranks)


# public spellings used by some scripts
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# ------------------------------------------------------------------ model / tensor parallel (the mpu's)
def _get_model_parallel_group():
    return _mpu.get_model_parallel_group() if _mpu is not None else None


def _get_model_parallel_world_size() -> int:
    return int(_mpu.get_model_parallel_world_size()) if _mpu is not None else 1


def _get_model_parallel_rank() -> int:
    return int(_mpu.get_model_parallel_rank()) if _mpu is not None else 0


get_tensor_model_parallel_group = get_model_parallel_group = _get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank = _get_model_parallel_rank


# ------------------------------------------------------------------ sequence parallel (one rank)
def _get_sequence_parallel_group():
    return None


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group():
    """Sequence x data parallel: the data-parallel group (sequence parallelism has one rank)."""
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


# ------------------------------------------------------------------ expert parallel (MoE)
def _expert_name(expert_parallel_size: int) -> str:
    return f"ep_size_{int(expert_parallel_size)}"


def _all_data_parallel_groups() -> List[List[int]]:
    """The global ranks of every data-parallel group of the world (each rank's, gathered), sorted."""
    mine = group_ranks(_get_data_parallel_group()) if comm.is_initialized() else [0]
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return [mine]
    return sorted({tuple(r) for r in comm.all_gather_object(mine)})


def expert_layout(dp_ranks: List[int], expert_parallel_size: int,
                  use_data_before_expert_parallel_: bool = False) -> Tuple[List[List[int]], List[List[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of one data-parallel group's global
    ranks (pure: the layout described in the module docstring)."""
    d, e = len(dp_ranks), int(expert_parallel_size)
    if e < 1 or d % e:
        raise ValueError(f"expert parallel size {e} must divide the data-parallel world size {d} "
                         f"(valid: {[k for k in range(1, d + 1) if d % k == 0]})")
    blocks, strided = d // e, e
    if not use_data_before_expert_parallel_:
        ep = [dp_ranks[b * e:(b + 1) * e] for b in range(blocks)]
        edp = [dp_ranks[i::e] for i in range(strided)]
    else:
        edp = [dp_ranks[b * blocks:(b + 1) * blocks] for b in range(e)]
        ep = [dp_ranks[i::blocks] for i in range(blocks)]
    return ep, edp


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False):
    """Create the ``"ep_size_<E>"`` expert-parallel and expert-data-parallel groups (every rank
    must call it, in the same order; a second call for the same E does nothing)."""
    name = _expert_name(expert_parallel_size_)
    if name in _expert_parallel:
        return
    me = comm.get_rank() if comm.is_initialized() else 0
    layouts = [expert_layout(list(dp), expert_parallel_size_, use_data_before_expert_parallel_)
               for dp in _all_data_parallel_groups()]
    for kind, store in ((0, _expert_parallel), (1, _expert_data_parallel)):
        for layout in layouts:
            for ranks in layout[kind]:
                group = _new_group(ranks)
                if me in ranks:
                    store[name] = (group, list(ranks))


def _new_group(ranks: List[int]):
    if not comm.is_initialized():
        return None
    if len(ranks) == comm.get_world_size():
        return _world_group()
    return comm.new_group(ranks)


def _lookup(store, group_name: str, what: str):
    if group_name not in store:
        known = ", ".join(sorted(store)) or "none yet"
        raise KeyError(f"no {what} group named {group_name!r} (created: {known}); a MoE layer creates "
                       f"'ep_size_<E>' on first use, or call _create_expert_and_data_parallel(E)")
    return store[group_name]


def _get_expert_parallel_group(group_name: str):
    return _lookup(_expert_parallel, group_name, "expert-parallel")[0]


def _get_expert_parallel_ranks(group_name: str) -> List[int]:
    return list(_lookup(_expert_parallel, group_name, "expert-parallel")[1])


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_lookup(_expert_parallel, group_name, "expert-parallel")[1])


def _get_expert_parallel_rank(group_name: str) -> int:
    ranks = _lookup(_expert_parallel, group_name, "expert-parallel")[1]
    return ranks.index(comm.get_rank() if comm.is_initialized() else 0)


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    return _lookup(_expert_parallel, group_name, "expert-parallel")[1][0]


def _get_expert_data_parallel_group(group_name: str):
    return _lookup(_expert_data_parallel, group_name, "expert-data-parallel")[0]


def _get_expert_data_parallel_ranks(group_name: str) -> List[int]:
    return list(_lookup(_expert_data_parallel, group_name, "expert-data-parallel")[1])


def expert_data_parallel_comm(group_name: str):
    """The comm layer bound to this rank's expert-data-parallel group ``group_name`` (see
    :func:`data_parallel_comm`)."""
    from ..comm.bound import GroupComm

    return GroupComm(comm, _get_expert_data_parallel_group(group_name), _get_expert_data_parallel_ranks(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_lookup(_expert_data_parallel, group_name, "expert-data-parallel")[1])


def _get_expert_data_parallel_rank(group_name: str) -> int:
    ranks = _lookup(_expert_data_parallel, group_name, "expert-data-parallel")[1]
    return ranks.index(comm.get_rank() if comm.is_initialized() else 0)


def _get_expert_parallel_group_dict() -> Dict[str, object]:
    return {name: group for name, (group, _r) in _expert_parallel.items()}


def _get_expert_data_parallel_group_dict() -> Dict[str, object]:
    return {name: group for name, (group, _r) in _expert_data_parallel.items()}


def _get_max_expert_size() -> Optional[int]:
    """The largest expert-parallel size created so far (None when there is none)."""
    sizes = [int(name.split("_")[-1]) for name in _expert_parallel]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return _expert_name(_get_max_expert_size() or 1)


def refuse_per_slice_decisions(kernel_config, precision) -> None:
    """With several model-parallel slices, gradient clipping and the fp16 overflow check would be
    decided per slice (the ZeRO stages agree on them over the data-parallel group only), so
    parameters replicated across slices could drift apart: refused, with the keys named."""
    if _get_model_parallel_world_size() <= 1:
        return
    clip = float(getattr(kernel_config, "gradient_clipping", 0.0) or 0.0)
    if clip > 0:
        raise ValueError(f"gradient_clipping={clip} with a model-parallel unit of {_get_model_parallel_world_size()} "
                         "slices is not available in dsplug: the gradient norm is taken over this slice's data-parallel "
                         "group only, so each slice would clip by its own norm; remove gradient_clipping")
    if getattr(precision, "checks_overflow", False):
        raise ValueError(f"{precision.name} with a model-parallel unit of {_get_model_parallel_world_size()} slices is "
                         "not available in dsplug: the overflow check and loss scale are agreed over the data-parallel "
                         "group only, so slices would skip different steps; use bf16 or fp32")


def create_expert_groups(module) -> List[str]:
    """Create the ``"ep_size_<E>"`` groups the module's MoE expert parameters name (``group_name``
    of every ``allreduce=False`` parameter), as DeepSpeed's engine does, so that a model whose
    layers have not run yet trains without an explicit set-up call. Every rank calls it; returns
    the names (the union over the ranks: the same list everywhere)."""
    import re

    names = {getattr(p, "group_name", None) for p in module.parameters() if not getattr(p, "allreduce", True)}
    if comm.is_initialized() and comm.get_world_size() > 1:
        # the union over every rank, created in one order everywhere (a pipeline stage without
        # experts must still join the group creations of the stages with them)
        names = set().union(*comm.all_gather_object(sorted(n for n in names if n is not None)))
    for name in sorted(n for n in names if n is not None):
        match = re.fullmatch(r"ep_size_(\d+)", str(name))
        if match is None:
            raise ValueError(f"an expert parameter has group_name={name!r}; expert groups are named "
                             "'ep_size_<expert parallel size>' (dsplug.moe sets it)")
        _create_expert_and_data_parallel(int(match.group(1)))
    return sorted(n for n in names if n is not None)


def broadcast_module_state(module, dp_comm) -> None:
    """Make every data-parallel replica start from the same weights: each parameter and buffer is
    broadcast from the first rank of the group that holds the same tensor -- the data-parallel
    group (``dp_comm``, rank 0), or for a MoE expert parameter (``allreduce=False``, ``group_name``)
    its expert-data-parallel group, since the ranks of an expert-parallel group hold different
    experts."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            name = getattr(p, "group_name", None) if not getattr(p, "allreduce", True) else None
            if name is None:
                dp_comm.broadcast(p.data, src=0)
            else:
                ranks = _get_expert_data_parallel_ranks(name)
                if len(ranks) > 1:
                    comm.broadcast(p.data, src=ranks[0], group=_get_expert_data_parallel_group(name))
        for b in module.buffers():
            dp_comm.broadcast(b.data, src=0)


def _reset_for_tests() -> None:
    """Forget the mpu and the expert groups (a new process group makes them stale)."""
    global _mpu
    _mpu = None
    _expert_parallel.clear()
    _expert_data_parallel.clear()


def initialize(ep_size: int = 1, mpu=None) -> None:
    """DeepSpeed's legacy set-up: record ``mpu`` and create the ``ep_size`` expert groups."""
    set_mpu(mpu)
    _create_expert_and_data_parallel(ep_size)


def is_initialized(group: Optional[object] = None) -> bool:
    return comm.is_initialized()
