"""Expert weights in checkpoints, one file per expert (DeepSpeed's layout), loadable at another
expert-parallel size.

Saving (hook ``dsplug_checkpoint_files``): the expert entries of the module state are taken out
of the shared model file; the ranks whose expert-data-parallel rank is 0 (one replica of every
expert) each write, for every MoE layer and every local expert, the file
``layer_<moe_layer_id>_expert_<global_expert_id>_mp_rank_<mp>_model_states.pt`` holding that
expert's state dict under the model's names with the GLOBAL expert id
(``...deepspeed_moe.experts.deepspeed_experts.<global id>...``). ``moe_layer_id`` numbers the
model's MoE layers in module order; ``global id = expert-parallel rank * num_local_experts +
local id``. The shared file records the layout under ``"moe"``; each rank's file the global ids
of the experts whose optimizer state it holds.

Loading (hook ``dsplug_checkpoint_read``, before any part loads): each rank reads the files of
ITS experts under this run's layout and puts them back into the module state under its local
names, so the module loads whole, whatever the ``ep_size`` / world size the checkpoint was saved
with (the total ``num_experts`` of each layer must match). The ZeRO stage's optimizer state
follows the parameters of each rank's file: when a rank's experts differ from those of the file
it reads (another ``ep_size`` or world size), resuming the optimizer state is refused with a
message -- pass ``load_module_only=True`` (or, at ZeRO stage 0, ``load_optimizer_states=False``,
which still loads the scheduler and counters).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional

import torch

from .utils import moe_layers

#: the key of the shared (``scope="model"``) and rank files
STATE_KEY = "moe"
EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."


def expert_file(moe_layer_id: int, global_expert_id: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file name of one expert of one MoE layer."""
    return f"layer_{moe_layer_id}_expert_{global_expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def _prefix(layer_name: str) -> str:
    """Module-state key prefix of a layer's experts (``<layer>.deepspeed_moe.experts.deepspeed_experts.``)."""
    return (layer_name + EXPERTS_INFIX) if layer_name else EXPERTS_INFIX[1:]


def _ep_rank(layer) -> int:
    from . import groups

    layer.deepspeed_moe.ensure_ep_group()
    return groups._get_expert_parallel_rank(layer.expert_group_name)


def _edp_rank(layer) -> int:
    from . import groups

    layer.deepspeed_moe.ensure_ep_group()
    return groups._get_expert_data_parallel_rank(layer.expert_group_name)


def local_experts(layer) -> List[int]:
    """Global ids of the experts this rank holds, by local id."""
    first = _ep_rank(layer) * layer.num_local_experts
    return list(range(first, first + layer.num_local_experts))


def _split_key(key: str, prefix: str):
    """``(expert id, rest)`` for a key under ``prefix`` (``"3.0.weight"`` -> (3, "0.weight"))."""
    match = re.match(r"(\d+)\.(.*)$", key[len(prefix):])
    if match is None:
        raise ValueError(f"unexpected MoE expert key {key!r}")
    return int(match.group(1)), match.group(2)


def layout(model: torch.nn.Module) -> List[Dict[str, object]]:
    return [{"name": name, "num_experts": layer.num_experts, "ep_size": layer.ep_size,
             "num_local_experts": layer.num_local_experts} for name, layer in moe_layers(model)]


# ------------------------------------------------------------------ save
def checkpoint_state(engine, scope: str) -> Optional[dict]:
    layers = moe_layers(engine.module)
    if not layers:
        return None
    if scope == "model":
        return {STATE_KEY: {"layers": layout(engine.module), "format": 1}}
    return {STATE_KEY: {"experts": [local_experts(layer) for _, layer in layers]}}


def checkpoint_files(engine, shared: dict, mp_rank: int) -> Optional[Dict[str, dict]]:
    """Take the expert entries out of ``shared["module"]`` and return this rank's expert files."""
    layers = moe_layers(engine.module)
    if not layers:
        return None
    module_state = shared.get("module")
    if module_state is None:  # a stage that keeps no module state in the shared file: take the module's own
        module_state = engine.module.state_dict()
    files: Dict[str, dict] = {}
    for layer_id, (name, layer) in enumerate(layers):
        prefix = _prefix(name)
        keys = [k for k in list(module_state) if k.startswith(prefix)]
        entries = {k: module_state.pop(k) for k in keys}
        if _edp_rank(layer) != 0:
            continue  # another rank writes this replica of the experts
        ids = local_experts(layer)
        per_expert: Dict[int, dict] = {g: {} for g in ids}
        for key, value in entries.items():
            local, rest = _split_key(key, prefix)
            value = value.detach().clone() if torch.is_tensor(value) else value  # own storage: one expert only
            per_expert[ids[local]][f"{prefix}{ids[local]}.{rest}"] = value
        for global_id, state in per_expert.items():
            files[expert_file(layer_id, global_id, mp_rank)] = state
    return files


# ------------------------------------------------------------------ load
def checkpoint_read(engine, checkpoint, mp_rank: int, weights_only: bool = True) -> None:
    """Put the expert weights of this rank's experts back into ``checkpoint.model["module"]``."""
    from dsplug.checkpoint import CheckpointError, load_file

    layers = moe_layers(engine.module)
    saved = checkpoint.model.get(STATE_KEY)
    if not layers:
        if saved:
            raise CheckpointError(f"{checkpoint.path} holds MoE layers ({_describe(saved['layers'])}) but the model "
                                  "has none")
        return
    module_state = checkpoint.model.get("module")
    if saved is None or module_state is None:
        return  # not saved by this plugin (the module state holds the experts whole, if at all)
    saved_layers = saved.get("layers", [])
    current = layout(engine.module)
    if len(saved_layers) != len(current):
        raise CheckpointError(f"{checkpoint.path} has {len(saved_layers)} MoE layer(s) ({_describe(saved_layers)}), "
                              f"the model {len(current)} ({_describe(current)})")
    for layer_id, ((name, layer), before) in enumerate(zip(layers, saved_layers)):
        if int(before["num_experts"]) != layer.num_experts:
            raise CheckpointError(f"MoE layer {layer_id} ({name}): the checkpoint {checkpoint.path} has "
                                  f"{before['num_experts']} experts, the model {layer.num_experts}; num_experts must "
                                  "match (ep_size may differ)")
        prefix = _prefix(name)
        for local, global_id in enumerate(local_experts(layer)):
            path = os.path.join(checkpoint.path, expert_file(layer_id, global_id, mp_rank))
            if not os.path.isfile(path):
                raise CheckpointError(f"MoE layer {layer_id} ({name}): expert file {path} is missing")
            own = f"{prefix}{global_id}."
            for key, value in load_file(path, weights_only).items():
                if not key.startswith(own):
                    raise CheckpointError(f"{path}: key {key!r} is not one of expert {global_id} of {name!r} "
                                          f"(expected the prefix {own!r})")
                module_state[f"{prefix}{local}.{key[len(own):]}"] = value
    _check_optimizer_layout(engine, checkpoint, layers)


def _check_optimizer_layout(engine, checkpoint, layers) -> None:
    options = checkpoint.options
    if options.load_module_only or not options.load_optimizer_states:
        return
    saved = (checkpoint.rank or {}).get(STATE_KEY)
    if saved is None:
        return
    mine = [local_experts(layer) for _, layer in layers]
    if [list(ids) for ids in saved.get("experts", [])] != mine:
        from dsplug.checkpoint import CheckpointError

        raise CheckpointError(
            f"{checkpoint.path}: this rank holds the experts {mine} (by MoE layer) but the optimizer state it would "
            f"load was saved for the experts {saved.get('experts')} (another ep_size or world size): the ZeRO stage's "
            "optimizer state cannot be re-sliced over experts. Pass load_module_only=True to load the weights "
            "(experts re-sliced) with a fresh optimizer, or at ZeRO stage 0 load_optimizer_states=False to load the "
            "weights, the LR scheduler and the counters with fresh optimizer state")


def _describe(layers) -> str:
    return ", ".join(f"{entry['name'] or '<model>'}: {entry['num_experts']} experts, ep_size {entry['ep_size']}"
                     for entry in layers) or "none"
