"""The partitioned checkpoint layouts of ``docs/zero-stages.md``: where each parameter's elements
sit in the ranks' partitions (``contiguous``: stages 1/2, ``per_param``: stage 3), and merging
every rank's partitions back into full tensors (:func:`merge_partitions`: the offline
consolidation of :mod:`.zero_to_fp32`, the DeepSpeed reader of :mod:`.deepspeed_format`, and the
stages' re-slicing of a checkpoint saved at another world size)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dsplug.checkpoint import MODEL_FILE, CheckpointError

LAYOUTS = ("contiguous", "per_param")

#: (rank, start in that rank's partition, length): one piece of a parameter
Piece = Tuple[int, int, int]

# ------------------------------------------------------------------------------ layout arithmetic
#: a contiguous group is padded to a multiple of this times the world size (DeepSpeed's
#: ``nccl_start_alignment_factor``: ZeRO-1/2 partitions are then DeepSpeed's, element for element)
CONTIGUOUS_ALIGNMENT = 2


def contiguous_partition_numel(numel: int, world_size: int) -> int:
    """Elements per rank when a group of ``numel`` elements is padded to a multiple of
    ``2 * world_size`` (DeepSpeed's ZeRO-1/2 partitioning)."""
    a = CONTIGUOUS_ALIGNMENT
    return max(a, a * math.ceil(numel / (a * world_size)))


def valid_contiguous_partition(partition: int, numel: int, world_size: int) -> bool:
    """A saved contiguous partition size is usable when the ranks' partitions cover the group
    (checkpoints of earlier dsplug versions padded only to a multiple of the world size)."""
    return partition >= 1 and partition * world_size >= numel and partition >= math.ceil(numel / world_size)


def split_range(start: int, length: int, partition_numel: int) -> List[Piece]:
    """Split the flat range ``[start, start+length)`` of a contiguous layout into per-owner pieces."""
    pieces, pos, end = [], start, start + length
    while pos < end:
        rank = pos // partition_numel
        stop = min(end, (rank + 1) * partition_numel)
        pieces.append((rank, pos - rank * partition_numel, stop - pos))
        pos = stop
    return pieces


def param_pieces(layout: str, numels: Sequence[int], world_size: int,
                 partition: Optional[int] = None) -> List[List[Piece]]:
    """For each parameter of a group, in order, the pieces that concatenated rebuild it
    (``partition``: a contiguous group's saved partition size; default: this version's)."""
    if layout == "contiguous":
        partition = partition or contiguous_partition_numel(sum(numels), world_size)
        out, offset = [], 0
        for n in numels:
            out.append(split_range(offset, n, partition))
            offset += n
        return out
    if layout == "per_param":
        out, offset = [], 0
        for n in numels:
            chunk = math.ceil(n / world_size)
            pieces = []
            for rank in range(world_size):
                length = min(n, (rank + 1) * chunk) - rank * chunk
                if length > 0:
                    pieces.append((rank, offset, length))
            out.append(pieces)
            offset += chunk
        return out
    raise CheckpointError(f"unknown partition layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def layout_partition_numel(layout: str, numels: Sequence[int], world_size: int) -> int:
    if layout == "contiguous":
        return contiguous_partition_numel(sum(numels), world_size)
    return sum(math.ceil(n / world_size) for n in numels)


# ------------------------------------------------------------------------------ merging
class MergedGroup:
    """One optimizer param group rebuilt whole from every rank's partition.

    names / shapes: the parameters, in the saved order
    fp32:    name -> full fp32 tensor (parameter shape)
    state:   optimizer state key -> name -> full tensor (element-wise state, e.g. exp_avg)
    scalars: per-group scalar state (e.g. step), from rank 0
    hyper:   the param group's hyper-parameters
    """

    def __init__(self, names, shapes, fp32, state, scalars, hyper):
        self.names: List[str] = names
        self.shapes: List[torch.Size] = shapes
        self.fp32: Dict[str, torch.Tensor] = fp32
        self.state: Dict[str, Dict[str, torch.Tensor]] = state
        self.scalars: Dict[str, Any] = scalars
        self.hyper: Dict[str, Any] = hyper


def _is_elementwise(value, partition_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == partition_numel


def validate_rank_states(states: Sequence[dict], where: str = "checkpoint") -> None:
    """Check that ``states`` (index = rank) describe one consistent partitioned checkpoint."""
    if not states:
        raise CheckpointError(f"{where}: no rank files to merge")
    first = states[0]
    if not isinstance(first, dict) or "layout" not in first or "groups" not in first:
        stage = first.get("zero_stage", "?") if isinstance(first, dict) else "?"
        raise CheckpointError(
            f"{where}: rank 0's optimizer state has no partition description (layout/groups); it was not "
            f"saved by a partitioned ZeRO stage (1-3){'' if stage == '?' else f', zero_stage={stage}'}. A stage-0 "
            f"checkpoint's {MODEL_FILE} already holds the full module weights")
    layout, world = first["layout"], int(first["world_size"])
    if layout not in LAYOUTS:
        raise CheckpointError(f"{where}: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if len(states) != world:
        raise CheckpointError(f"{where}: rank 0 says world_size={world} but {len(states)} rank file(s) were given")
    for rank, state in enumerate(states):
        for key, want in (("layout", layout), ("world_size", world), ("rank", rank),
                          ("zero_stage", first.get("zero_stage"))):
            if state.get(key) != want:
                raise CheckpointError(f"{where}: rank {rank}'s file has {key}={state.get(key)!r}, expected {want!r}")
        if len(state["groups"]) != len(first["groups"]):
            raise CheckpointError(f"{where}: rank {rank} has {len(state['groups'])} param groups, rank 0 has "
                                  f"{len(first['groups'])}")
        for gi, (group, ref) in enumerate(zip(state["groups"], first["groups"])):
            if list(group["names"]) != list(ref["names"]) or [tuple(s) for s in group["shapes"]] != \
                    [tuple(s) for s in ref["shapes"]]:
                raise CheckpointError(f"{where}: group {gi} of rank {rank} lists other parameters than rank 0's")
            numels = [math.prod(s) for s in group["shapes"]]
            if sum(numels) != int(group["numel"]):
                raise CheckpointError(f"{where}: group {gi} of rank {rank}: numel={group['numel']} but its shapes "
                                      f"hold {sum(numels)} elements")
            want_part = layout_partition_numel(layout, numels, world)
            saved_part = int(group["partition_numel"])
            if layout == "contiguous" and valid_contiguous_partition(saved_part, sum(numels), world):
                want_part = saved_part
            if saved_part != want_part or group["fp32"].numel() != want_part:
                raise CheckpointError(
                    f"{where}: group {gi} of rank {rank}: partition_numel={group['partition_numel']}, fp32 has "
                    f"{group['fp32'].numel()} elements; the {layout} layout of {sum(numels)} elements over "
                    f"{world} ranks gives {want_part}")


def merge_partitions(states: Sequence[dict], where: str = "checkpoint") -> List[MergedGroup]:
    """Rebuild every group's full fp32 weights and element-wise optimizer state from all ranks."""
    validate_rank_states(states, where)
    layout, world = states[0]["layout"], int(states[0]["world_size"])
    merged = []
    for gi, ref in enumerate(states[0]["groups"]):
        names, shapes = list(ref["names"]), [torch.Size(s) for s in ref["shapes"]]
        partition = int(ref["partition_numel"])
        pieces = param_pieces(layout, [math.prod(s) for s in shapes], world, partition)
        parts = [s["groups"][gi] for s in states]

        def rebuild(tensors: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
            out = {}
            for name, shape, plist in zip(names, shapes, pieces):
                chunks = [tensors[r][start:start + n] for r, start, n in plist]
                flat = torch.cat(chunks) if len(chunks) != 1 else chunks[0].clone()
                out[name] = flat.view(shape)
            return out

        fp32 = rebuild([p["fp32"].to(torch.float32) for p in parts])
        state, scalars = {}, {}
        for key, value in ref.get("state", {}).items():
            if _is_elementwise(value, partition):
                tensors = [p["state"][key] for p in parts]
                if any(not _is_elementwise(t, partition) for t in tensors):
                    raise CheckpointError(f"{where}: optimizer state {key!r} of group {gi} is not aligned with the "
                                          "fp32 partition on every rank")
                state[key] = rebuild(tensors)
            else:
                scalars[key] = value
        merged.append(MergedGroup(names, shapes, fp32, state, scalars, dict(ref.get("hyper", {}))))
    return merged
