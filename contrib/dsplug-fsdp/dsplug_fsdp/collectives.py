"""FSDP2's two collectives, issued through dsplug's comm layer (``context.comm``).

FSDP2 lets a module replace the all-gather of its parameters and the reduce-scatter of its
gradients (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). The objects
below do both through ``context.comm``, so the comms logger, the fault diagnosis and the
collective timeout see them like any other stage's, and gloo (which has no reduce-scatter) gets
dsplug's ring reduce-scatter.

Averaging follows dsplug's other stages: the module is told to reduce with a plain sum and a
divide factor of 1 (FSDP2 then divides by 1), and :class:`CommReduceScatter` itself applies
``prescale_gradients`` (divide by N before the sum) or ``gradient_predivide_factor`` (divide by
it before, multiply by ``factor / N`` after).

FSDP2 calls these with ``group`` = the process group of the mesh this stage built from
``context.comm``'s group, so the group argument is left to ``context.comm``. Both run to
completion and return None (FSDP2 then waits for nothing).
"""
from __future__ import annotations

import torch


class _Allocating:
    def allocate(self, size, *, dtype, device):
        return torch.empty(tuple(size), dtype=dtype, device=device)


class CommAllGather(_Allocating):
    """``output`` := every rank's ``input`` side by side (rank-major)."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        self.comm.all_gather_into_tensor(output_tensor, input_tensor)
        return None


class CommReduceScatter(_Allocating):
    """``output`` := this rank's slice of the average over ranks of ``input`` (a rank-major buffer
    FSDP2 filled with every gradient of one unit)."""

    def __init__(self, comm, world_size: int, rank: int, prescale: bool, predivide: float,
                 use_reduce_scatter: bool = True):
        self.comm = comm
        self.world_size = world_size
        self.rank = rank
        self.prescale = bool(prescale)
        self.predivide = float(predivide)
        self.use_reduce_scatter = use_reduce_scatter

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        if self.prescale:
            input_tensor.div_(self.world_size)
        elif self.predivide != 1.0:
            input_tensor.div_(self.predivide)
        if self.use_reduce_scatter:
            self.comm.reduce_scatter_tensor(output_tensor, input_tensor)
        else:  # zero_optimization.reduce_scatter: false
            self.comm.all_reduce(input_tensor)
            output_tensor.copy_(input_tensor.view(self.world_size, -1)[self.rank])
        if not self.prescale:
            output_tensor.mul_(self.predivide / self.world_size)
        return None
