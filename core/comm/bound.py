"""The comm layer bound to one process group: what a plugin gets as ``context.comm``.

ZeRO stages, precision and optimizer plugins talk to "the data-parallel group". Without model
parallelism that is the world, and ``context.comm`` is :mod:`dsplug.comm` itself. With a user's
model-parallel unit (``initialize(mpu=...)``) or a pipeline grid it is one of several groups, and
``context.comm`` is a :class:`GroupComm` over it, so the same plugin code runs unchanged:

* every collective defaults to ``group=<the bound group>`` (an explicit ``group=`` still wins);
* ``get_rank()`` / ``get_world_size()`` answer inside the group;
* rank arguments (``dst`` of reduce / send, ``src`` of broadcast / recv / broadcast_object) are
  GROUP ranks, translated to the global ranks torch.distributed expects; ``recv`` returns the
  sender's group rank.

Anything else (``ReduceOp``, ``events``, ``operation``, ...) is the comm module's: a new
collective of the comm layer needs a method here too (tests/core/test_parallel_groups.py checks that
every public function taking ``group`` has one).
"""
from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist


class GroupComm:
    def __init__(self, comm_module, group, ranks: List[int]):
        self._comm = comm_module
        self.group = group
        #: global ranks of the group, in group-rank order
        self.ranks = list(ranks)
        self._rank_of = {g: i for i, g in enumerate(self.ranks)}

    def __repr__(self) -> str:
        return f"GroupComm(ranks={self.ranks})"

    def __getattr__(self, name):
        return getattr(self._comm, name)

    # ------------------------------------------------------------------ ranks
    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def group_rank(self, global_rank: int) -> int:
        return self._rank_of[global_rank]

    def get_rank(self, group=None) -> int:
        if group is not None and group is not self.group:
            return self._comm.get_rank(group)
        return self._rank_of[self._comm.get_rank()]

    def get_world_size(self, group=None) -> int:
        if group is not None and group is not self.group:
            return self._comm.get_world_size(group)
        return len(self.ranks)

    def get_backend(self, group=None) -> str:
        return self._comm.get_backend(self._g(group))

    def _g(self, group):
        return self.group if group is None else group

    def _to_global(self, rank, group):
        return self.ranks[rank] if group is None and rank is not None else rank

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        return self._comm.all_reduce(tensor, op=op, group=self._g(group), async_op=async_op)

    def broadcast(self, tensor, src: int, group=None, async_op: bool = False):
        return self._comm.broadcast(tensor, src=self._to_global(src, group), group=self._g(group), async_op=async_op)

    def reduce(self, tensor, dst: int, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        return self._comm.reduce(tensor, dst=self._to_global(dst, group), op=op, group=self._g(group),
                                 async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op: bool = False):
        return self._comm.all_gather(tensor_list, tensor, group=self._g(group), async_op=async_op)

    def all_gather_into_tensor(self, output, input, group=None, async_op: bool = False):
        return self._comm.all_gather_into_tensor(output, input, group=self._g(group), async_op=async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        return self._comm.reduce_scatter_tensor(output, input, op=op, group=self._g(group), async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op: bool = False):
        return self._comm.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                            input_split_sizes=input_split_sizes, group=self._g(group),
                                            async_op=async_op)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
        return self._comm.all_to_all(output_tensor_list, input_tensor_list, group=self._g(group), async_op=async_op)

    def barrier(self, group=None) -> None:
        return self._comm.barrier(group=self._g(group))

    def all_gather_object(self, obj, group=None) -> list:
        return self._comm.all_gather_object(obj, group=self._g(group))

    def broadcast_object(self, obj, src: int = 0, group=None):
        return self._comm.broadcast_object(obj, src=self._to_global(src, group), group=self._g(group))

    def send(self, tensor, dst: int, group=None, tag: int = 0) -> None:
        return self._comm.send(tensor, dst=self._to_global(dst, group), group=self._g(group), tag=tag)

    def recv(self, tensor, src: Optional[int] = None, group=None, tag: int = 0) -> int:
        sender = self._comm.recv(tensor, src=self._to_global(src, group), group=self._g(group), tag=tag)
        return self._rank_of.get(sender, sender) if group is None else sender

    def isend(self, tensor, dst: int, group=None, tag: int = 0):
        return self._comm.isend(tensor, dst=self._to_global(dst, group), group=self._g(group), tag=tag)

    def irecv(self, tensor, src: Optional[int] = None, group=None, tag: int = 0):
        return self._comm.irecv(tensor, src=self._to_global(src, group), group=self._g(group), tag=tag)
