"""MoE expert parameters under ZeRO: where each parameter's gradient is averaged (its domain)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


def expert_domains(params: List[torch.nn.Parameter]) -> Dict[Optional[str], List[torch.nn.Parameter]]:
    """Parameters by where their gradients are averaged: None -> the data-parallel group; an
    expert group name -> that group's expert-data-parallel group.

    MoE expert parameters carry DeepSpeed's marks ``allreduce = False`` and ``group_name =
    "ep_size_<E>"`` (:mod:`dsplug.moe`). Each rank's expert gradient already holds the
    contributions of the tokens the E ranks of its expert-parallel group routed to it, so summing
    over the expert-data-parallel group (the D/E ranks holding the same experts) covers all D
    data-parallel ranks once; dividing by D then gives the gradient of the average loss, as for
    the dense parameters (a single process on the whole batch computes the same)."""
    domains: Dict[Optional[str], List[torch.nn.Parameter]] = {}
    for p in params:
        name = None if getattr(p, "allreduce", True) else getattr(p, "group_name", None)
        if not getattr(p, "allreduce", True) and name is None:
            raise ValueError("a parameter has allreduce=False but no group_name: dsplug reduces such (MoE expert) "
                             "parameters in the expert-data-parallel group named by group_name ('ep_size_<E>')")
        domains.setdefault(name, []).append(p)
    return domains


def refuse_expert_parameters(param_groups, stage: int) -> None:
    """Stage 3 partitions every parameter over the whole data-parallel group; MoE expert
    parameters (``allreduce=False``) differ between the ranks of an expert-parallel group, so they
    need partitions over their expert-data-parallel group, which dsplug builds at stages 0-2."""
    experts = [p for g in param_groups for p in g["params"] if not getattr(p, "allreduce", True)]
    if experts:
        name = getattr(experts[0], "group_name", "?")
        raise ValueError(f"zero_optimization.stage={stage}: the model has {len(experts)} MoE expert parameter(s) "
                         f"(allreduce=False, group {name!r}); dsplug trains MoE models at ZeRO stages 0-2 (experts "
                         "partitioned and averaged in their expert-data-parallel group); stage 3 with experts is not "
                         "built yet: set zero_optimization.stage to 0, 1 or 2")
