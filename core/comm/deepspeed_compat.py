"""DeepSpeed's ``deepspeed.comm`` names beyond dsplug's own collectives (``new_group``,
``get_world_group``, ``inference_all_reduce``, ``gather``, ``scatter``, ...; the point-to-point
and all-to-all ops are the comm layer's own), re-exported by
:mod:`dsplug.comm`. Collectives go through the comm layer's ``_run`` so they are reported
(``dsplug_comm_op``: the comms logger) like every other.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _nbytes, _run, all_gather_into_tensor, all_reduce, broadcast_object, get_world_size, \
    is_initialized, reduce_scatter_tensor, ReduceOp

__all__ = ["is_available", "get_world_group", "new_group", "get_global_rank", "get_all_ranks_from_group",
           "monitored_barrier", "inference_all_reduce", "gather", "scatter", "broadcast_object_list",
           "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "allgather_fn", "reduce_scatter_fn",
           "get_local_world_size"]


def is_available() -> bool:
    """Whether torch.distributed can be used in this build of torch."""
    return dist.is_available()


def get_world_group():
    """The default (world) process group (None before :func:`init_distributed`)."""
    return dist.group.WORLD if is_initialized() else None


def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
    """A new process group of ``ranks`` (every rank must call it, as torch requires); its timeout
    defaults to dsplug's bound (``comm_timeout_s`` / ``DSPLUG_COMM_TIMEOUT``), not torch's."""
    from . import get_timeout

    kwargs = {"ranks": ranks, "backend": backend, "pg_options": pg_options}
    kwargs["timeout"] = timeout if timeout is not None else get_timeout()
    return dist.new_group(**kwargs)


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> List[int]:
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def monitored_barrier(group=None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo)."""
    _run("barrier", 0, lambda: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks),
         False, group)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """DeepSpeed's inference all-reduce: here the same as :func:`all_reduce`."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)



def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    return _run("gather", _nbytes(tensor) * get_world_size(group),
                lambda: dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op),
                async_op, group)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    return _run("scatter", _nbytes(tensor) * get_world_size(group),
                lambda: dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op),
                async_op, group)






def broadcast_object_list(object_list: list, src: int = 0, group=None, device=None) -> None:
    """torch's form: ``object_list`` takes ``src``'s objects on every rank (in place)."""
    object_list[:] = broadcast_object(list(object_list), src=src, group=group)


def has_all_gather_into_tensor() -> bool:
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    return hasattr(dist, "reduce_scatter_tensor")


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op: bool = False,
                 debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                      async_op: bool = False, prof: bool = False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def get_local_world_size() -> int:
    """Processes on this node (``LOCAL_WORLD_SIZE`` as the launcher sets it; 1 when unset)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1
