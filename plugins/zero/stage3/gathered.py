"""``GatheredParameters``: see or change the full value of partitioned parameters.

::

    with dsplug.zero.GatheredParameters(model.linear.weight, modifier_rank=0):
        if dsplug.comm.get_rank() == 0:
            model.linear.weight.normal_()       # rank 0's values win

On entry every listed partitioned parameter is gathered (a collective: every rank must enter).
On exit, with ``modifier_rank=None`` the full values are dropped again (changes are lost); with
``modifier_rank=r`` rank r's full values are broadcast, every rank stores its slice into its
partition (and the ZeRO stage refreshes its fp32 master copy), then the full values are dropped.
Parameters stage 3 does not partition go to the kernel's
``dsplug.contracts.zero_stage.gathered_parameters``, which hands each to the ZeRO stage that trains
it (``ZeroStage.gathered``: a third-party stage's parameters gather there); the others are left
alone, and if nothing needs gathering the context does nothing.

:class:`PartitionedGathered` is the gather of stage 3's own parameters alone (what
``PartitionedParamStage.gathered`` returns); :class:`GatheredParameters` adds the hand-over.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Union

import torch

from .external import register_external_parameter
from .partitioned_param import is_partitioned, unique


def _as_list(params) -> List[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None]


class PartitionedGathered:
    """Gathers the parameters of ``params`` that stage 3 partitioned; leaves the others alone."""

    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter], None],
                 modifier_rank: Optional[int] = None, fwd_module: Optional[torch.nn.Module] = None,
                 enabled: bool = True):
        params = _as_list(params)
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


class GatheredParameters(PartitionedGathered):
    """DeepSpeed's ``deepspeed.zero.GatheredParameters``: stage 3's partitioned parameters are
    gathered here, every other parameter by the ZeRO stage that trains it (kernel service
    ``gathered_parameters``); ``enabled=False`` gathers nothing."""

    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter], None],
                 modifier_rank: Optional[int] = None, fwd_module: Optional[torch.nn.Module] = None,
                 enabled: bool = True):
        params = _as_list(params)
        super().__init__(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)
        self.others = None
        if enabled:
            from dsplug.contracts.zero_stage import gathered_parameters

            self.others = gathered_parameters([p for p in params if not is_partitioned(p)], modifier_rank)
        self._stack = None

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            super().__enter__()
            stack.push(super().__exit__)
            if self.others is not None:
                stack.enter_context(self.others)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc_info) if stack is not None else False
