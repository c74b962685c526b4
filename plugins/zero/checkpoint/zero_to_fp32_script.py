#!/usr/bin/env python
"""Consolidate a ZeRO checkpoint into one fp32 state dict (written by dsplug into every checkpoint
folder, like DeepSpeed's script of the same name). Needs only torch: no dsplug, no DeepSpeed, no
config, no process group.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_FILE [-t TAG]

CHECKPOINT_DIR is the folder holding ``latest`` (or a tag folder itself); TAG defaults to the one
``latest`` names. OUTPUT_FILE receives ``torch.save(state_dict)`` (an existing directory: its
``pytorch_model.bin``). Reads dsplug's partitioned format (``"stage"`` in each rank's
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``) and DeepSpeed's (ZeRO stages 1-3). Trainable
parameters come from the fp32 partitions (no precision loss); buffers and frozen parameters from
the model-states file as saved. Files load with ``torch.load(weights_only=True)``; DeepSpeed's few
pickled classes (loss scaler, stage enum, fragment address) are read as plain records.

The same from Python: ``from zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint``.
"""
import argparse
import math
import os
import sys
from collections import OrderedDict

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"


class _LoadedRecord:
    def __init__(self, *args, **state):
        self.__dict__.update(state)


def _record(module, name):
    return type(name, (_LoadedRecord,), {"__module__": module, "__qualname__": name})


def _int(value):
    return int(value)


_FOREIGN = [(_record("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (_record("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
             "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
            (_record("deepspeed.utils.tensor_fragment", "fragment_address"),
             "deepspeed.utils.tensor_fragment.fragment_address"),
            (_int, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def _load(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing")
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:  # torch < 2.5
        return torch.load(path, map_location="cpu", weights_only=True)
    with safe_globals(_FOREIGN):
        return torch.load(path, map_location="cpu", weights_only=True)


def _optim_file(tag_dir, rank):
    for prefix in ("", "bf16_"):
        path = os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{tag_dir}: no optimizer states of rank {rank} (zero_pp_rank_{rank}_mp_rank_00_optim_"
                            "states.pt): the files of every rank are needed")


def resolve_tag_dir(checkpoint_dir, tag=None):
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
        elif any(n.endswith("_optim_states.pt") or n.endswith("model_states.pt") for n in os.listdir(checkpoint_dir)):
            return checkpoint_dir
        else:
            raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file: pass -t TAG")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint tag folder {path} does not exist")
    return path


def _model_state(tag_dir):
    for name in (MODEL_FILE, "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return _load(os.path.join(tag_dir, name))
    return {}


# ------------------------------------------------------------------------------ dsplug's format
def _dsplug_params(states):
    """name -> fp32 tensor from every rank's ``"stage"`` (docs/zero-stages.md)."""
    first = states[0]
    world, layout = int(first["world_size"]), first["layout"]
    out = OrderedDict()
    for gi, ref in enumerate(first["groups"]):
        names, shapes = list(ref["names"]), [torch.Size(s) for s in ref["shapes"]]
        parts = [s["groups"][gi]["fp32"].float().reshape(-1) for s in states]
        if layout == "contiguous":
            flat, offset = torch.cat(parts), 0
            for name, shape in zip(names, shapes):
                n = math.prod(shape)
                out[name] = flat[offset:offset + n].clone().view(shape)
                offset += n
        elif layout == "per_param":
            offset = 0
            for name, shape in zip(names, shapes):
                n = math.prod(shape)
                k = math.ceil(n / world)
                out[name] = torch.cat([p[offset:offset + k] for p in parts])[:n].clone().view(shape)
                offset += k
        else:
            raise ValueError(f"unknown partition layout {layout!r}")
    return out


# ------------------------------------------------------------------------------ DeepSpeed's format
def _deepspeed_params(optims, param_shapes, world):
    stage = int(optims[0]["zero_stage"])
    out = OrderedDict()
    if stage <= 2:
        for gi, shape_map in enumerate(param_shapes):
            flat = torch.cat([o["single_partition_of_fp32_groups"][gi].float().reshape(-1) for o in optims])
            offset = 0
            for name, shape in shape_map.items():
                n = math.prod(shape)
                out[name] = flat[offset:offset + n].clone().view(shape)
                offset += n
        return out
    for si, shape_map in enumerate(param_shapes):
        parts = [o["fp32_flat_groups"][si].float().reshape(-1) for o in optims]
        offset = 0
        for name, shape in shape_map.items():
            n = math.prod(shape)
            k = math.ceil(n / world)
            out[name] = torch.cat([p[offset:offset + k] for p in parts])[:n].clone().view(shape)
            offset += k
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None):
    """The consolidated fp32 state dict of a ZeRO checkpoint (see the module docstring)."""
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    model = _model_state(tag_dir)
    module = model.get("module") or {}
    has_optim = any(n.endswith("_optim_states.pt") for n in os.listdir(tag_dir))
    first = _load(_optim_file(tag_dir, 0)) if has_optim else {}
    if isinstance(first.get("stage"), dict) and "layout" in first["stage"]:
        world = int(first["stage"]["world_size"])
        states = [first["stage"]] + [_load(_optim_file(tag_dir, r))["stage"] for r in range(1, world)]
        params = _dsplug_params(states)
    elif "optimizer_state_dict" in first:
        world = int(model.get("dp_world_size") or 1)
        optims = [first["optimizer_state_dict"]] + [_load(_optim_file(tag_dir, r))["optimizer_state_dict"]
                                                    for r in range(1, world)]
        params = _deepspeed_params(optims, model["param_shapes"], world)
    else:  # ZeRO stage 0: the module is whole; fp32 master weights when they were kept
        params = OrderedDict()
        saved = model.get("optimizer")
        if isinstance(saved, dict) and saved.get("fp32_groups"):
            trainable = [n for n, v in module.items() if torch.is_tensor(v) and v.is_floating_point()]
            masters = [t for g in saved["fp32_groups"] for t in g]
            if len(masters) == len(trainable):
                params = OrderedDict(zip(trainable, (m.float() for m in masters)))
    out = OrderedDict()
    for key, value in module.items():
        if key in params:
            out[key] = params[key]
        elif torch.is_tensor(value) and value.is_floating_point() and value.numel() > 0:
            out[key] = value.float()
        else:
            out[key] = value
    for key, value in params.items():
        out.setdefault(key, value)
    return out


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None):
    if os.path.isdir(output_file):
        output_file = os.path.join(output_file, "pytorch_model.bin")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    tmp = f"{output_file}.tmp-{os.getpid()}"
    torch.save(dict(state), tmp)
    os.replace(tmp, output_file)
    total = sum(t.numel() for t in state.values() if torch.is_tensor(t))
    print(f"saved {len(state)} tensors ({total:,} elements) to {output_file}")
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description="Consolidate a ZeRO checkpoint into one fp32 state dict")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holding 'latest'), or a tag folder")
    parser.add_argument("output_file", help="where to torch.save the state dict (a directory: pytorch_model.bin)")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    args = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"zero_to_fp32: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
