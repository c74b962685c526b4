"""Parameter helpers for MoE models (DeepSpeed's ``deepspeed.moe.utils``).

Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<N>"`` (set by
:class:`dsplug.moe.experts.Experts`). ZeRO averages them over their expert-data-parallel group
only, and wants them in optimizer parameter groups of their own (``"moe": True``, ``"name":
group_name``): :func:`split_params_into_different_moe_groups_for_optimizer` makes those groups.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

#: DeepSpeed's default cap on the elements of one MoE parameter group
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (``allreduce`` set to False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: Iterable[torch.nn.Parameter]) -> Tuple[list, list]:
    """``(shared, expert)`` lists of ``params``."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: Iterable[torch.nn.Parameter]) -> Tuple[list, list]:
    """``(shared grads, expert grads)`` of the parameters in ``group`` that have a gradient."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _as_group_list(param_groups) -> List[dict]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups[{i}] must be "
                                 f"a dict with a 'params' key (an optimizer parameter group), got "
                                 f"{type(group).__name__}")
        return groups
    raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict, a list or "
                     f"a tuple of parameter-group dicts, got {type(param_groups).__name__}")


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=DEFAULT_MAX_GROUP_SIZE) \
        -> Tuple[dict, ...]:
    """Move the expert parameters of each group into groups of their own.

    For every input group and every expert group name ``"ep_size_<N>"`` among its parameters, new
    groups are appended holding those expert parameters, with the input group's options (lr,
    weight_decay, ...) and ``"moe": True``, ``"name": "ep_size_<N>"``; the input group keeps its
    other parameters. With ``max_group_size`` (elements) the expert parameters of one name are
    split into consecutive groups of at most that many elements (a single larger parameter gets
    a group alone). Returns a tuple of groups (the input groups first, each possibly empty).
    ``params`` may be any iterable (``model.parameters()``); each input group should carry a
    ``"name"`` (DeepSpeed requires one; a missing one is named ``"group<i>"`` here).
    """
    groups = _as_group_list(param_groups)
    if max_group_size is not None and int(max_group_size) < 1:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: max_group_size must be a positive "
                         f"number of elements or None, got {max_group_size!r}")
    result: List[dict] = []
    moe_groups: List[dict] = []
    for i, group in enumerate(groups):
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        dense = [p for p in params if not is_moe_param(p)]
        by_name: Dict[str, List[torch.nn.Parameter]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(str(p.group_name), []).append(p)
        result.append({**group, "name": group.get("name", f"group{i}"), "params": dense})
        options = {k: v for k, v in group.items() if k not in ("params", "name")}
        for name, expert_params in by_name.items():
            for chunk in _chunks(expert_params, max_group_size):
                moe_groups.append({**options, "name": name, "moe": True, "params": chunk})
    return tuple(result + moe_groups)


def _chunks(params: List[torch.nn.Parameter], max_group_size) -> List[List[torch.nn.Parameter]]:
    if max_group_size is None:
        return [params]
    chunks: List[List[torch.nn.Parameter]] = []
    current: List[torch.nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > int(max_group_size):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks


def moe_layers(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of every :class:`dsplug.moe.layer.MoE` in ``model``, in module order
    (the order gives each its ``moe_layer_id`` in checkpoints)."""
    from .layer import MoE

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def has_moe_layers(model: torch.nn.Module) -> Tuple[bool, int]:
    """``(True, num_experts of the last MoE layer)`` when ``model`` has MoE layers, else ``(False, 0)``."""
    layers = moe_layers(model)
    return (True, layers[-1][1].num_experts) if layers else (False, 0)


def is_moe_param_group(param_group: dict) -> bool:
    """True for an optimizer group made by :func:`split_params_into_different_moe_groups_for_optimizer`."""
    return bool(param_group.get("moe", False))
