"""Rebuild full fp32 weights from a partitioned ZeRO (stage 1-3) checkpoint, offline.

Reads only the checkpoint files, in the format of ``docs/zero-stages.md``: every rank's
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds ``{"stage": {...}}`` describing its
partitions (``layout`` "contiguous" for stages 1/2, "per_param" for stage 3). No config and no
process group are needed::

    from dsplug.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints/")       # tag from 'latest'
    model.load_state_dict(state_dict)

or from the shell: ``dsplug zero-to-fp32 checkpoints/ pytorch_model.bin``.

The trainable parameters come from the fp32 partitions (no precision loss). Entries of the
module state that are not partitioned (buffers, frozen parameters) are taken from
``mp_rank_00_model_states.pt`` as saved; a tied alias of a trainable parameter gets its fp32 value.

:func:`merge_partitions` also rebuilds the element-wise optimizer state; ZeRO stages use it to
load a checkpoint saved with N ranks at M ranks.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dsplug.checkpoint import MODEL_FILE, CheckpointError, LATEST, atomic_save, check_tag, load_file, optim_file

LAYOUTS = ("contiguous", "per_param")

#: (rank, start in that rank's partition, length): one piece of a parameter
Piece = Tuple[int, int, int]

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "merge_partitions",
    "param_pieces",
    "MergedGroup",
]


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


# ------------------------------------------------------------------------------ files
def _has_rank_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f"{p}{optim_file(0)}")) for p in ("", "bf16_"))


def resolve_tag_dir(checkpoint_dir: str, tag: Optional[str] = None) -> str:
    """The directory holding the rank files: ``checkpoint_dir/tag``, ``checkpoint_dir/<latest>``,
    or ``checkpoint_dir`` itself when it is a tag directory and no tag is given."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    if tag is None:
        if _has_rank_files(checkpoint_dir):
            return checkpoint_dir
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"{checkpoint_dir} has no '{LATEST}' file and no tag was given; pass a tag "
                                  f"({_tags_hint(checkpoint_dir)})")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, check_tag(str(tag)))  # a plain tag name inside checkpoint_dir
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint tag directory {path} does not exist ({_tags_hint(checkpoint_dir)})")
    return path


def _tags_hint(checkpoint_dir: str) -> str:
    tags = sorted(d for d in os.listdir(checkpoint_dir) if os.path.isdir(os.path.join(checkpoint_dir, d)))
    return f"tags in {checkpoint_dir}: {', '.join(tags)}" if tags else f"{checkpoint_dir} holds no tag directories"


def read_rank_states(tag_dir: str, weights_only: bool = True) -> List[dict]:
    """Every rank's ``stage`` state of a tag directory, index = rank (a DeepSpeed checkpoint is
    translated into dsplug's format, :mod:`.deepspeed_format`)."""
    from . import deepspeed_format

    deepspeed_format.register_safe_globals()
    if _is_deepspeed(tag_dir, weights_only):
        ds = deepspeed_format.DeepSpeedCheckpoint(tag_dir, weights_only)
        return [ds.dsplug_stage_state(r) for r in range(ds.world_size)]
    first = load_file(os.path.join(tag_dir, optim_file(0)), weights_only)
    if "stage" not in first:
        raise CheckpointError(f"{os.path.join(tag_dir, optim_file(0))} has no 'stage' entry: not a dsplug "
                              "optimizer-state file")
    world = int(first["stage"].get("world_size", first.get("world_size", 1)))
    states = [first["stage"]]
    for rank in range(1, world):
        path = os.path.join(tag_dir, optim_file(rank))
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the checkpoint was saved by {world} ranks and every rank's "
                                  "file is needed to rebuild the weights")
        states.append(load_file(path, weights_only)["stage"])
    return states


def _is_deepspeed(tag_dir: str, weights_only: bool) -> bool:
    """Written by DeepSpeed: no dsplug model file, or one without dsplug's keys."""
    from .deepspeed_format import zero_model_file

    path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(path):
        return os.path.isfile(os.path.join(tag_dir, zero_model_file(0)))
    model = load_file(path, weights_only)
    return "ds_version" in model and "dsplug_version" not in model and not (
        os.path.isfile(os.path.join(tag_dir, optim_file(0)))
        and "stage" in load_file(os.path.join(tag_dir, optim_file(0)), weights_only))


def _module_state(tag_dir: str, weights_only: bool) -> Optional[dict]:
    from .deepspeed_format import zero_model_file

    path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(path):
        path = os.path.join(tag_dir, zero_model_file(0))  # DeepSpeed at stage 3: partitioned entries are empty
        if not os.path.isfile(path):
            return None
    return load_file(path, weights_only).get("module")


def _view_key(t) -> Optional[tuple]:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             weights_only: bool = True) -> "OrderedDict[str, torch.Tensor]":
    """The full fp32 state dict of a partitioned checkpoint (see the module docstring)."""
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    merged = merge_partitions(read_rank_states(tag_dir, weights_only), where=tag_dir)
    trainable: Dict[str, torch.Tensor] = {}
    for group in merged:
        trainable.update(group.fp32)
    module_state = _module_state(tag_dir, weights_only)
    if module_state is None:
        return OrderedDict(trainable)
    # a tied alias is saved as the same view of the same storage as its trainable parameter
    views = {_view_key(module_state[name]): name for name in trainable if _view_key(module_state.get(name))}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, value in module_state.items():
        source = key if key in trainable else views.get(_view_key(value))
        out[key] = trainable[source] if source is not None else value
    for key, value in trainable.items():
        out.setdefault(key, value)
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None,
                                         strict: bool = True) -> torch.nn.Module:
    """Load the consolidated fp32 weights into ``model`` (in its own dtype and device); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=strict)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag: Optional[str] = None,
                                               progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Write the consolidated fp32 state dict to ``output_file`` (``torch.save``); return it.

    ``output_file`` may be an existing directory: the file is then ``pytorch_model.bin`` in it.
    """
    output_file = os.fspath(output_file)
    if os.path.isdir(output_file):
        output_file = os.path.join(output_file, "pytorch_model.bin")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    parent = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {output_file}: directory {parent} does not exist")
    atomic_save(dict(state), output_file)
    if progress is not None:
        total = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
        progress(f"saved {len(state)} tensors ({total:,} elements) to {output_file}")
    return state
