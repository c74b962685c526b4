"""Which rows of a parameter each rank holds, and full tensors from those rows.

FSDP2 shards every parameter along dim 0 as ``torch.chunk`` does: with N ranks and d rows,
chunks of ``c = ceil(d / N)`` rows, rank r holding rows ``[r*c, min((r+1)*c, d))`` (the last
ranks may hold fewer, or none). The optimizer state of this stage is aligned with those rows, so
the same arithmetic re-slices a checkpoint for another number of ranks.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch


def rows_of(dim0: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(start, length)`` of the rows rank ``rank`` holds of a tensor with ``dim0`` rows."""
    chunk = math.ceil(dim0 / world_size) if dim0 else 0
    start = min(rank * chunk, dim0)
    return start, max(0, min(chunk, dim0 - start))


def gather_rows(comm, local: torch.Tensor, shape: Sequence[int], world_size: int) -> torch.Tensor:
    """The full tensor of ``shape`` whose rows are spread over the ranks as :func:`rows_of` says,
    from this rank's ``local`` rows. A collective (one all-gather through ``comm``): every rank
    calls it with its own rows of the same tensor."""
    shape = tuple(shape)
    dim0 = shape[0]
    chunk = math.ceil(dim0 / world_size) if dim0 else 0
    padded = local.new_zeros((chunk, *shape[1:]))
    padded[:local.shape[0]].copy_(local)
    if world_size == 1:
        return padded[:dim0].clone()
    out = local.new_empty((chunk * world_size, *shape[1:]))
    comm.all_gather_into_tensor(out, padded)
    return out[:dim0].clone()


def local_rows(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``full`` (a view)."""
    start, length = rows_of(full.shape[0], world_size, rank)
    return full.narrow(0, start, length)
