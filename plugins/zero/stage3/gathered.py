"""``GatheredParameters``: see or change the full value of partitioned parameters.

::

    with dsplug.zero.GatheredParameters(model.linear.weight, modifier_rank=0):
        if dsplug.comm.get_rank() == 0:
            model.linear.weight.normal_()       # rank 0's values win

On entry every listed partitioned parameter is gathered (a collective: every rank must enter).
On exit, with ``modifier_rank=None`` the full values are dropped again (changes are lost); with
``modifier_rank=r`` rank r's full values are broadcast, every rank stores its slice into its
partition (and the ZeRO stage refreshes its fp32 master copy), then the full values are dropped.
Parameters that are not partitioned are left alone; if none is, the context does nothing.
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from .external import register_external_parameter
from .partitioned_param import is_partitioned, unique


class GatheredParameters:
    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter], None],
                 modifier_rank: Optional[int] = None, fwd_module: Optional[torch.nn.Module] = None,
                 enabled: bool = True):
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        else:
            params = list(params)
        self.params = unique(p for p in params if is_partitioned(p))
        self.enabled = bool(enabled) and bool(self.params)
        self.modifier_rank = modifier_rank
        if not self.enabled:
            return
        self.by_partitioner = {}
        for p in self.params:
            self.by_partitioner.setdefault(p._ds_partitioner, []).append(p)
        if modifier_rank is not None:
            world = self.params[0]._ds_partitioner.world_size
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
                raise ValueError(f"GatheredParameters: modifier_rank={modifier_rank!r} is not a rank of the "
                                 f"data-parallel group (0..{world - 1}), nor None")
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self):
        if self.enabled:
            for partitioner, params in self.by_partitioner.items():
                partitioner.hold(params, +1)
                partitioner.fetch(params)
        return self

    def __exit__(self, *exc_info):
        if not self.enabled:
            return False
        for partitioner, params in self.by_partitioner.items():
            try:
                if self.modifier_rank is not None and exc_info[0] is None:
                    with torch.no_grad():
                        for p in params:
                            partitioner.comm.broadcast(p.data, src=self.modifier_rank)
                    partitioner.write_back(params)
            finally:
                partitioner.hold(params, -1)
                partitioner.release(params)
        return False
