"""The kernel's process groups: data parallelism and a user's model-parallel unit (mpu).

Without a model-parallel unit the data-parallel group is the world. With one
(``dsplug.initialize(mpu=...)``, :func:`set_mpu`), the data-parallel, model-parallel and tensor-
parallel answers are the mpu's; sequence parallelism has one rank. The names are DeepSpeed's
(``deepspeed.utils.groups``): the plugin that provides ``dsplug.utils.groups`` (dsplug's MoE
plugin, which adds the expert-parallel groups) serves these under that path.

Groups that only some parameters use (MoE experts) are a plugin's: the ``dsplug_reduction_groups``
hook creates them and ``dsplug_param_reduction`` maps a parameter to one
(:meth:`dsplug.context.BuildContext.reduction_of`); :func:`broadcast_module_state` follows it.
"""
from __future__ import annotations

from typing import List

from .. import comm


#: the model-parallel unit given to ``initialize(mpu=...)`` / :func:`set_mpu` (None: data parallel only)
_mpu = None

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
    from .bound import GroupComm

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


def broadcast_module_state(module, context) -> None:
    """Make every replica start from the same weights: each parameter is broadcast from the first
    rank of the group of ranks holding the same value -- its reduction group
    (``context.reduction_of(p).comm``: the data-parallel group unless a plugin says otherwise,
    e.g. a MoE expert's expert-data-parallel group) -- and each buffer over the data-parallel
    group (``context.comm``). Every rank calls it, with the parameters in the same order.

    In a world of one process the broadcasts of the parameters averaged over the data-parallel
    group are still issued (each an identity), as DeepSpeed does: a comms log at one rank then
    lists what more ranks would send. A group of one inside a larger world (a MoE expert no other
    rank holds) sends nothing. A DTensor parameter (a stage that placed the module with
    ``torch.distributed.tensor``, e.g. FSDP2) is skipped: its placement is the stage's own."""
    import torch

    alone = context.comm.get_world_size() == 1
    with torch.no_grad():
        for p in module.parameters():
            if _is_dtensor(p):
                continue
            reduction = context.reduction_of(p)
            if reduction.comm.get_world_size() > 1 or (alone and reduction.key is None):
                reduction.comm.broadcast(p.data, src=0)
        for b in module.buffers():
            context.comm.broadcast(b.data, src=0)


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _reset_for_tests() -> None:
    """Forget the mpu (a new process group makes it stale)."""
    global _mpu
    _mpu = None


def is_initialized(group=None) -> bool:
    return comm.is_initialized()
