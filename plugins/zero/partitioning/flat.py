"""The contiguous partitioning of ZeRO stages 1 and 2.

Each optimizer param group is flattened, in order, into one buffer in the model dtype, padded at
the end to a multiple of the world size N; rank r owns elements ``[r*P, (r+1)*P)`` (``P`` =
partition numel). The module's parameters become views into that buffer, so gathering the
updated partitions writes the module's weights directly. This is the ``"contiguous"`` layout of
``docs/zero-stages.md``; its arithmetic (pieces of a parameter per owner) is shared with the
offline consolidation (:mod:`dsplug.plugins.zero.checkpoint.layout`).

``round_robin_gradients`` flattens a group's parameters in round-robin order (0, N, 2N, ..., then
1, N+1, ...): neighbouring layers then fall into different ranks' partitions, so the gradient
reductions of one backward pass go to every rank in turn instead of to one rank at a time. The
checkpoint's ``names`` list the parameters in flattening order, so consolidation needs nothing else.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ..checkpoint.layout import Piece, contiguous_partition_numel, split_range


def round_robin_order(items: Sequence, world_size: int) -> List:
    """``items`` regrouped by index modulo ``world_size``: 0, N, 2N, ..., 1, N+1, ..."""
    return [items[i] for start in range(world_size) for i in range(start, len(items), world_size)]


class FlatGroup:
    """One param group flattened into ``world_size * partition_numel`` elements of ``dtype``.

    params / names / shapes: in flattening order. After construction every parameter's ``data``
    is a view into :attr:`buffer` (its values are kept).
    """

    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], world_size: int, rank: int,
                 dtype: torch.dtype, device):
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.world_size, self.rank = world_size, rank
        self.offsets: List[int] = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.numel = offset
        self.partition_numel = contiguous_partition_numel(self.numel, world_size)
        self.buffer = torch.zeros(self.partition_numel * world_size, dtype=dtype, device=device)
        with torch.no_grad():
            for p, start, n in zip(self.params, self.offsets, self.numels):
                view = self.buffer[start:start + n].view(p.shape)
                view.copy_(p.detach())
                p.data = view
        self.position: Dict[torch.nn.Parameter, int] = {p: i for i, p in enumerate(self.params)}

    def partition(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the buffer (a view)."""
        return self.buffer[rank * self.partition_numel:(rank + 1) * self.partition_numel]

    @property
    def local(self) -> torch.Tensor:
        return self.partition(self.rank)

    def pieces(self, param: torch.nn.Parameter) -> List[Piece]:
        """``(owner, start in owner's partition, length)`` pieces of ``param``, in element order."""
        i = self.position[param]
        return split_range(self.offsets[i], self.numels[i], self.partition_numel)

    def describe(self) -> dict:
        return {"names": list(self.names), "shapes": [torch.Size(s) for s in self.shapes], "numel": self.numel,
                "partition_numel": self.partition_numel}

    def flatten(self, tensors: Dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """The full padded flat buffer of per-name ``tensors`` (e.g. merged checkpoint state)."""
        flat = torch.zeros(self.partition_numel * self.world_size, dtype=dtype)
        for name, start, n in zip(self.names, self.offsets, self.numels):
            flat[start:start + n].copy_(tensors[name].reshape(-1))
        return flat


def chunk_ranges(length: int, chunk: int) -> List[range]:
    """``[0, length)`` cut into consecutive ranges of at most ``chunk`` elements."""
    chunk = max(1, chunk)
    return [range(a, min(length, a + chunk)) for a in range(0, length, chunk)]


def gather_partitions(groups: List[FlatGroup], comm, bucket_elements: int, use_broadcast: bool,
                      in_flight: int = 2) -> None:
    """Give every rank the updated partitions of every other rank (in place, into the buffers).

    All-gather: each collective gathers at most ``bucket_elements`` elements in all
    (``bucket_elements // N`` from each rank). Broadcast: each rank's piece of the same span is
    broadcast from its owner. At most ``in_flight`` spans are outstanding at a time, which bounds
    the temporary input copies to ``in_flight`` buckets.
    """
    pending: List[list] = []
    for group in groups:
        world = group.world_size
        for span in chunk_ranges(group.partition_numel, max(1, bucket_elements // world)):
            outputs = [group.partition(r)[span.start:span.stop] for r in range(world)]
            if use_broadcast:
                works = [comm.broadcast(outputs[r], src=r, async_op=True) for r in range(world)]
                pending.append([works])
            elif span.stop - span.start == group.partition_numel:
                # the whole buffer is the rank-major output: gather in place (an input that is the
                # rank's own slot of the output is the documented in-place form)
                pending.append([[comm.all_gather_into_tensor(group.buffer, group.local, async_op=True)]])
            else:
                source = outputs[group.rank].clone()  # the input must not alias its own output slot
                pending.append([[comm.all_gather(outputs, source, async_op=True)], source])
            if len(pending) >= in_flight:
                _wait(pending.pop(0)[0])
    for entry in pending:
        _wait(entry[0])


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()
