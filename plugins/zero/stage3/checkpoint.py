"""The partitioned checkpoint format of docs/zero-stages.md, read and written for stage 3.

Writing uses the ``per_param`` layout. Reading accepts both layouts (so a stage 1/2 checkpoint
also loads at stage 3) at any saved world size: :func:`consolidate` rebuilds each parameter's
full fp32 value and element-wise optimizer state from every rank's description, and the stage
then takes its own slice.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from dsplug.checkpoint import CheckpointError

from .partitioned_param import partition_numel


class CheckpointFormatError(CheckpointError, ValueError):
    """The checkpoint's partitions cannot be loaded here (a ``CheckpointError``, so the engine
    reports it as it is; a ``ValueError`` as it always was)."""


def is_elementwise(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def is_scalar(value) -> bool:
    return not torch.is_tensor(value) or value.dim() == 0


def flatten_group_state(optimizer, views: Sequence[torch.Tensor]) -> dict:
    """The optimizer state of one group as ``{name: flat tensor aligned with fp32 | scalar}``."""
    keys: List[str] = []
    for v in views:
        for key in optimizer.state.get(v, {}):
            if key not in keys:
                keys.append(key)
    state = {}
    for key in keys:
        values = [optimizer.state.get(v, {}).get(key) for v in views]
        sample_view, sample = next((v, x) for v, x in zip(views, values) if x is not None)
        if is_elementwise(sample, sample_view.numel()) and sample_view.numel() > 0:
            state[key] = torch.cat([x.reshape(-1) if x is not None else torch.zeros_like(v)
                                    for v, x in zip(views, values)])
        elif is_scalar(sample):
            state[key] = sample.clone() if torch.is_tensor(sample) else sample
        else:
            raise CheckpointFormatError(
                f"optimizer state {key!r} has shape {tuple(sample.shape)}: neither one value per element of the "
                "parameter nor a scalar, so the partitioned checkpoint format cannot hold it (use an element-wise "
                "optimizer such as Adam/AdamW/SGD at ZeRO stage 3)")
    return state


def _split(flats: List[torch.Tensor], shapes, world: int, layout: str) -> List[torch.Tensor]:
    numels = [math.prod(s) for s in shapes]
    if layout == "contiguous":
        full = torch.cat([f.reshape(-1) for f in flats])[: sum(numels)]
        return [t.view(s) for t, s in zip(torch.split(full, numels), shapes)]
    if layout == "per_param":
        out, offset = [], 0
        for n, shape in zip(numels, shapes):
            k = partition_numel(n, world)
            out.append(torch.cat([f[offset:offset + k] for f in flats])[:n].view(shape))
            offset += k
        return out
    raise CheckpointFormatError(f"unknown partitioned checkpoint layout {layout!r} (expected 'per_param' or "
                                "'contiguous')")


def check_partitioned(state, where: str = "the checkpoint") -> None:
    if not isinstance(state, dict) or "layout" not in state or "groups" not in state:
        saved = state.get("zero_stage", 0) if isinstance(state, dict) else "?"
        raise CheckpointFormatError(
            f"{where} holds no partitioned ZeRO state (saved at ZeRO stage {saved}); ZeRO stage 3 can load only "
            "checkpoints of stages 1-3. Load it with load_module_only=True to start from its weights")


def consolidate(rank_states: List[dict]) -> Dict[str, dict]:
    """``name -> {"fp32", "state", "scalars", "hyper", "group"}`` with full (unpartitioned) tensors."""
    first = rank_states[0]
    world, layout = int(first["world_size"]), first["layout"]
    if len(rank_states) != world:
        raise CheckpointFormatError(f"the checkpoint was saved by {world} ranks but {len(rank_states)} rank files "
                                    "were given")
    out: Dict[str, dict] = {}
    for gi, group in enumerate(first["groups"]):
        names, shapes = group["names"], [torch.Size(s) for s in group["shapes"]]
        elementwise = [k for k, v in group["state"].items() if is_elementwise(v, group["partition_numel"])]
        scalars = {k: v for k, v in group["state"].items() if k not in elementwise}
        fp32 = _split([rs["groups"][gi]["fp32"] for rs in rank_states], shapes, world, layout)
        states = {k: _split([rs["groups"][gi]["state"][k] for rs in rank_states], shapes, world, layout)
                  for k in elementwise}
        for i, name in enumerate(names):
            out[name] = {"fp32": fp32[i], "state": {k: states[k][i] for k in elementwise}, "scalars": scalars,
                         "hyper": group.get("hyper", {}), "group": gi}
    return out
