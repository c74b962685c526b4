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

Merging the partitions is :func:`.layout.merge_partitions`, which also rebuilds the element-wise
optimizer state (the ZeRO stages use it to load a checkpoint saved with N ranks at M ranks).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch

from dsplug.checkpoint import LATEST, MODEL_FILE, atomic_save, check_tag, CheckpointError, load_file, optim_file

from . import deepspeed_format
from .layout import LAYOUTS, MergedGroup, Piece, merge_partitions, param_pieces  # noqa: F401 - public names

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_optim_files",
    "merge_partitions",
    "param_pieces",
    "MergedGroup",
]

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
    zero_model_file = deepspeed_format.zero_model_file
    path = os.path.join(tag_dir, MODEL_FILE)
    if not os.path.isfile(path):
        return os.path.isfile(os.path.join(tag_dir, zero_model_file(0)))
    model = load_file(path, weights_only)
    return "ds_version" in model and "dsplug_version" not in model and not (
        os.path.isfile(os.path.join(tag_dir, optim_file(0)))
        and "stage" in load_file(os.path.join(tag_dir, optim_file(0)), weights_only))


def _module_state(tag_dir: str, weights_only: bool) -> Optional[dict]:
    zero_model_file = deepspeed_format.zero_model_file
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


def _natural_key(path: str):
    """Sort key that orders embedded numbers by value (``zero_2`` before ``zero_10``)."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", os.path.basename(path))]


def get_optim_files(checkpoint_dir) -> List[str]:
    """The optimizer-state files (``*_optim_states.pt``) of a tag directory, ordered by the numbers in
    their names (rank 2 before rank 10), as DeepSpeed lists them. FileNotFoundError when there is none."""
    import glob

    checkpoint_dir = str(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir} is not a directory: give a checkpoint tag directory")
    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt")), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"no *_optim_states.pt file in {checkpoint_dir}: is it a checkpoint tag directory?")
    return files
