"""DeepSpeed's ``deepspeed.utils.groups`` (``dsplug.utils.groups``, declared by this plugin): the
process groups a training script, Hugging Face Transformers / Accelerate, MoE layers and ZeRO
stages ask about.

* Data, model, tensor and sequence parallelism are the kernel's (:mod:`dsplug.comm.groups`, the
  data-parallel group and a user's model-parallel unit); their DeepSpeed names are re-exported
  here unchanged.
* Expert parallelism (MoE, DeepSpeed's layout) is this plugin's: :func:`_create_expert_and_data_parallel`
  splits every data-parallel group of D ranks into expert-parallel groups of E consecutive
  data-parallel ranks (the ranks that hold different experts of one layer and exchange tokens by
  all-to-all) and expert-data-parallel groups of the D/E ranks at the same position in their
  block (the ranks that hold the same experts and average their gradients). The groups are named
  ``"ep_size_<E>"``. With ``use_data_before_expert_parallel_`` the roles swap: expert-data-parallel
  groups are the consecutive blocks of D/E ranks and expert-parallel groups are strided.

The engine reaches the expert groups through the kernel's hooks only (:mod:`dsplug.plugins.moe.plugin`):
``dsplug_reduction_groups`` -> :func:`create_expert_groups`, ``dsplug_param_reduction`` ->
:func:`reduction_of`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from dsplug import comm
from dsplug.comm import groups as _kernel
from dsplug.comm.bound import GroupComm
from dsplug.comm.groups import (  # noqa: F401  (DeepSpeed's names, served under this path)
    MPU_METHODS, _clone_world_group, _get_broadcast_src_rank, _get_data_parallel_group, _get_data_parallel_rank,
    _get_data_parallel_world_size, _get_model_parallel_group, _get_model_parallel_rank,
    _get_model_parallel_world_size, _get_sequence_data_parallel_group, _get_sequence_data_parallel_rank,
    _get_sequence_data_parallel_world_size, _get_sequence_parallel_group, _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size, _get_world_group, _get_world_size, _get_zero_param_intra_parallel_group,
    _get_zero_param_intra_parallel_group_world_size, _get_zero_param_intra_parallel_rank_in_mygroup, _world_group,
    broadcast_module_state, data_parallel_comm, get_data_parallel_group, get_data_parallel_rank,
    get_data_parallel_world_size, get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size,
    get_mpu, get_tensor_model_parallel_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
    group_ranks, is_initialized, refuse_per_slice_decisions, set_mpu)

#: "ep_size_<E>" -> (expert-parallel group, its global ranks), (expert-data-parallel group, its ranks)
_expert_parallel: Dict[str, Tuple[object, List[int]]] = {}
_expert_data_parallel: Dict[str, Tuple[object, List[int]]] = {}


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
    return GroupComm(comm, _get_expert_data_parallel_group(group_name), _get_expert_data_parallel_ranks(group_name))


def expert_parallel_comm(group_name: str):
    """The comm layer bound to this rank's expert-parallel group ``group_name``."""
    return GroupComm(comm, _get_expert_parallel_group(group_name), _get_expert_parallel_ranks(group_name))


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


def create_expert_groups(module) -> List[str]:
    """Create the ``"ep_size_<E>"`` groups the module's MoE expert parameters name (``group_name``
    of every ``allreduce=False`` parameter), as DeepSpeed's engine does, so that a model whose
    layers have not run yet trains without an explicit set-up call. Every rank calls it; returns
    the names (the union over the ranks: the same list everywhere)."""
    import re

    names = {getattr(p, "group_name", None) for p in module.parameters() if is_expert(p)}
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


# ------------------------------------------------------------------ the kernel's hooks
#: what a stage's error messages call expert parameters, and how to give them param groups of their own
WHAT = "MoE expert parameters"
ADVICE = ("dsplug.moe.utils.split_params_into_different_moe_groups_for_optimizer(param_groups) does that, "
          "as DeepSpeed requires")


def is_expert(param) -> bool:
    """DeepSpeed's mark of an expert parameter: ``allreduce = False``."""
    return not getattr(param, "allreduce", True)


def reduction_of(param, context):
    """``dsplug_param_reduction`` for an expert parameter (``allreduce = False``, ``group_name =
    "ep_size_<E>"``): summed over its expert-data-parallel group and divided by the data-parallel
    world size. Each rank's expert gradient already holds the contributions of the tokens the E
    ranks of its expert-parallel group routed to it, so summing over the D/E ranks holding the
    same experts covers all D data-parallel ranks once; dividing by D gives the gradient of the
    average loss, as for the dense parameters (a single process on the whole batch computes the
    same). The expert-parallel group (every expert once) is its ``shard_comm``."""
    from dsplug.descriptors import Reduction

    name = getattr(param, "group_name", None)
    if name is None:
        raise ValueError("a parameter has allreduce=False but no group_name: dsplug reduces such (MoE expert) "
                         "parameters in the expert-data-parallel group named by group_name ('ep_size_<E>')")
    name = str(name)
    if name not in _comms:
        _comms[name] = (expert_data_parallel_comm(name), expert_parallel_comm(name))
    replicas, shards = _comms[name]
    return Reduction(name, replicas, context.world_size, shard_comm=shards, what=WHAT, advice=ADVICE)


#: group name -> (expert-data-parallel comm, expert-parallel comm), built once per group
_comms: Dict[str, Tuple[GroupComm, GroupComm]] = {}


def _reset_for_tests() -> None:
    """Forget the mpu and the expert groups (a new process group makes them stale)."""
    _kernel._reset_for_tests()
    _expert_parallel.clear()
    _expert_data_parallel.clear()
    _comms.clear()


def initialize(ep_size: int = 1, mpu=None) -> None:
    """DeepSpeed's legacy set-up: record ``mpu`` and create the ``ep_size`` expert groups."""
    set_mpu(mpu)
    _create_expert_and_data_parallel(ep_size)
