"""Where each parameter's gradient is averaged (its reduction domain), for every stage.

A parameter's :class:`dsplug.descriptors.Reduction` comes from ``context.reduction_of``: None key
for the data-parallel group, or the group a plugin names through ``dsplug_param_reduction`` (MoE
experts: their expert-data-parallel group). The divisor stays the data-parallel world size, so
the average is the same as a single process on the whole batch would compute.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch


#: the largest gradient bucket a stage reduces while backward goes on (``reduce_bucket_size`` when
#: smaller): a model under DeepSpeed's default 5e8 would otherwise be one bucket, reduced only
#: after backward has finished. The sums are the same whatever the bucketing.
OVERLAP_BUCKET_ELEMENTS = 2 ** 22


def overlap_bucket_elements(reduce_bucket_size) -> int:
    """Elements per gradient bucket for a reduction that overlaps backward."""
    return max(1, min(int(reduce_bucket_size), OVERLAP_BUCKET_ELEMENTS))


def reduction_domains(params: List[torch.nn.Parameter], reduction_of: Callable) -> Dict[Optional[str], tuple]:
    """Parameters by where their gradients are averaged: ``{key: (reduction, params)}`` in
    first-appearance order, ``reduction_of`` being ``context.reduction_of``
    (:class:`dsplug.descriptors.Reduction`; key None: the data-parallel group)."""
    domains: Dict[Optional[str], tuple] = {}
    for p in params:
        reduction = reduction_of(p)
        domains.setdefault(reduction.key, (reduction, []))[1].append(p)
    return domains


def refuse_other_reductions(param_groups, reduction_of, stage: int) -> None:
    """Stage 3 partitions every parameter over the whole data-parallel group: a parameter whose
    gradient a plugin averages in another group (``dsplug_param_reduction``) would need partitions
    over that group, which dsplug builds at stages 0-2 only."""
    others = [(p, r) for g in param_groups for p in g["params"] for r in [reduction_of(p)] if r.key is not None]
    if others:
        what, key = others[0][1].what, others[0][1].key
        raise ValueError(f"zero_optimization.stage={stage}: the model has {len(others)} {what} (averaged in the "
                         f"group {key!r}, not over the whole data-parallel group); ZeRO stage {stage} partitions "
                         "every parameter over the data-parallel group and cannot train them: set "
                         "zero_optimization.stage to 0, 1 or 2")
