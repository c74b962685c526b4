"""DeepSpeed's ``deepspeed.utils.groups``: the process groups a training script (and Hugging Face
Transformers / Accelerate) asks about.

dsplug trains data-parallel over the default process group: the data-parallel group is the world,
model (tensor) and sequence parallelism have one rank each. The answers are right before
``init_distributed`` too (a world of one process). Expert-parallel (MoE) groups are not provided
yet.
"""
from __future__ import annotations

from typing import Optional

from .. import comm


def _world_group():
    if not comm.is_initialized():
        return None
    import torch.distributed as dist

    return dist.group.WORLD


# ------------------------------------------------------------------ data parallel (= the world)
def _get_data_parallel_group():
    """The data-parallel process group: the default (world) group (None before init_distributed)."""
    return _world_group()


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    return comm.get_rank()


def _get_broadcast_src_rank() -> int:
    """The global rank that broadcasts to the data-parallel group."""
    return 0


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


# public spellings used by some scripts
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# ------------------------------------------------------------------ model / tensor parallel (one rank)
def _get_model_parallel_group():
    return None


def _get_model_parallel_world_size() -> int:
    return 1


def _get_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_group():
    return None


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_model_parallel_group():
    return None


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


# ------------------------------------------------------------------ sequence parallel (one rank)
def _get_sequence_parallel_group():
    return None


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group():
    """Sequence x data parallel: the data-parallel group (sequence parallelism has one rank)."""
    return _world_group()


def _get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return comm.get_rank()


def initialize(ep_size: int = 1, mpu=None) -> None:
    """DeepSpeed's legacy group set-up: only the data-parallel layout (``ep_size=1``, no ``mpu``)."""
    if mpu is not None:
        raise NotImplementedError("dsplug.utils.groups.initialize: model parallelism (mpu) is not available in "
                                  "dsplug; data parallelism uses the world group")
    if ep_size != 1:
        raise NotImplementedError(f"dsplug.utils.groups.initialize: ep_size={ep_size}: expert parallelism is not "
                                  "available in dsplug yet")


def is_initialized(group: Optional[object] = None) -> bool:
    return comm.is_initialized()
