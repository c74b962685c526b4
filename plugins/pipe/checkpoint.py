"""Pipeline checkpoints: loadable at the same layout exactly, and at another stage count layer by layer.

A pipeline engine saves like any engine (the shared file ``mp_rank_<stage>_model_states.pt`` of
each stage with its module, counters, scheduler and client state; ``zero_pp_rank_<dp>_mp_rank_<stage>
_optim_states.pt`` per rank with the ZeRO stage's and precision's state; RNG states), and adds,
through the kernel's ``dsplug_checkpoint_files`` hook (so the engine writes them crash-safely with
its own and lists them in the tag's ``manifest.json``), from each stage's first data-parallel rank:

* ``layer_XX-model_states.pt`` -- each layer's ``state_dict()`` (DeepSpeed's per-layer files;
  ``layer_XX-model_YY-model_states.pt`` with a tensor-model axis);
* ``layer_XX-optim_states.pt`` -- each layer's optimizer state, whole: for every trained
  parameter (by its name in the layer) the fp32 master value and the optimizer's state entries
  (gathered from the ZeRO-1 partitions through the stage's full-value API);
* ``pipe_stage_SS-layers.json`` -- the stage's layout (number of stages, boundaries, its layers
  and files).

Loading with the saved layout is the engine's ordinary load (module, optimizer, RNG: exact).
With another number of stages or other boundaries, each stage reads its layers' files (checked
against the manifest, like every checkpoint file): weights, fp32 masters and optimizer state go in
through the ZeRO stage's full-value API (an optimizer without state yet gets it from one step on
zero gradients whose update is undone), the optimizer's hyperparameters (lr ...) come from the
saved stage 0, and every other part (counters, scheduler, precision, client state, monitors)
loads from stage 0's shared file and this rank's data-parallel file as usual. Either way the tag
is resolved by the kernel (:func:`dsplug.engine_checkpoint.resolve_tag`). RNG states are not
carried across layouts (they belong to ranks). Scalar optimizer state (a step count) is the same
for every parameter of a layer and is written to every optimizer entry.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional

import torch

from dsplug import checkpoint as ckpt
from dsplug import comm, hookimpl
from dsplug.contracts.checkpoint import CheckpointView, LoadOptions
from dsplug.engine_checkpoint import resolve_tag
from dsplug.logging import log_rank0

from .module import layer_file_name

FORMAT = 1


def optim_file_name(idx: int, model_repr: str = "") -> str:
    return f"layer_{idx:02d}-{model_repr}-optim_states.pt" if model_repr else f"layer_{idx:02d}-optim_states.pt"


def index_file_name(stage: int, model_repr: str = "") -> str:
    return f"pipe_stage_{stage:02d}-{model_repr}-layers.json" if model_repr else f"pipe_stage_{stage:02d}-layers.json"


def _hyperparameters(optimizer) -> List[Dict[str, Any]]:
    if optimizer is None:
        return []
    return [{k: v for k, v in g.items() if k != "params" and not str(k).startswith("_dsplug")}
            for g in optimizer.param_groups]


def optimizer_state_keys(optimizer) -> List[str]:
    keys = set()
    for state in (optimizer.state.values() if optimizer is not None else ()):
        keys.update(state)
    return sorted(keys)


def _elementwise(value, param) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == tuple(param.shape)


class PipelineCheckpoint:
    """The pipeline engine's checkpoint participant (per-layer files)."""

    def __init__(self, engine):
        self.engine = engine

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        if scope != "model":
            return None
        engine, module = self.engine, self.engine.module
        record = {"format": FORMAT, "num_stages": module.num_stages, "parts": list(module.parts),
                  "num_layers": module._num_layers, "stage_id": module.stage_id,
                  "optimizer_param_groups": _hyperparameters(engine.basic_optimizer)}
        return {"pipe": record}

    @hookimpl
    def dsplug_checkpoint_files(self, options):
        """This stage's layer files and layout index (from its first data-parallel rank; every rank
        takes part in gathering the optimizer state)."""
        engine, module = self.engine, self.engine.module
        first = module.mpu().get_data_parallel_id() == 0
        model_repr = module._model_repr()
        files: Dict[str, Any] = {}
        if first:
            files.update(module.layer_state_dicts(exclude_frozen_params=options.exclude_frozen_parameters))
        keys = optimizer_state_keys(engine.basic_optimizer)
        for idx, layer in module.local_layer_modules():
            state = self._layer_optimizer_state(layer, keys)  # every data-parallel rank: may gather
            if first:
                files[optim_file_name(idx, model_repr)] = state
        if not first:
            return None
        index = {"format": FORMAT, "num_stages": module.num_stages, "parts": list(module.parts),
                 "num_layers": module._num_layers, "stage": module.stage_id, "layers": module.local_layers(),
                 "files": sorted(files)}
        files[index_file_name(module.stage_id, model_repr)] = json.dumps(index, indent=1, sort_keys=True).encode()
        return files

    def _layer_optimizer_state(self, layer, keys: List[str]) -> Dict[str, Any]:
        stage = self.engine.stage
        out = {}
        for name, p in layer.named_parameters():
            fp32 = stage.full_fp32_param(p)
            if fp32 is None:
                continue
            entry = {}
            for key in keys:
                value = stage.full_optimizer_state(p, key)
                if value is not None:
                    entry[key] = value.detach().cpu() if torch.is_tensor(value) else value
            out[name] = {"fp32": fp32.detach().cpu(), "state": entry}
        return out


# ------------------------------------------------------------------------------ loading
def _agree(what: str, fn: Callable[[], Any]):
    """Run ``fn`` on every rank; a failure anywhere raises everywhere (nobody is left waiting)."""
    error, result = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    outcomes = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text]
    if failed:
        if error is not None:
            raise error
        rank, text = failed[0]
        raise ckpt.CheckpointError(f"pipeline checkpoint {what} failed on rank {rank}: {text}; nothing was loaded")
    return result


def _read_index(path: str, stage: int, model_repr: str) -> Optional[dict]:
    """Stage ``stage``'s layout index (checked against the manifest), or None when the tag has none
    (a plain engine's checkpoint, or DeepSpeed's)."""
    name = os.path.join(path, index_file_name(stage, model_repr))
    if not os.path.isfile(name):
        return None
    data = ckpt.read_file_bytes(name)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise ckpt.CheckpointError(f"pipeline checkpoint index {name} is unreadable: {exc}") from exc


def load_pipeline_checkpoint(engine, load_dir, tag, flags: Dict[str, Any], same_layout: Callable[[str], Any]):
    module = engine.module
    path = resolve_tag(load_dir, tag)  # the kernel's: every load resolves tags alike
    if path is None:
        return None, None
    model_repr = module._model_repr()
    index0 = _agree("reading the layout", lambda: _read_index(path, 0, model_repr))
    if index0 is None or (index0["num_stages"] == module.num_stages and list(index0["parts"]) == list(module.parts)):
        return same_layout(os.path.basename(path))  # the engine's own load (also for checkpoints of a plain engine)
    if index0["num_layers"] != module._num_layers:
        raise ckpt.CheckpointError(f"{path} holds a pipeline of {index0['num_layers']} layers; this PipelineModule has "
                                   f"{module._num_layers}")
    log_rank0(f"[dsplug] pipeline checkpoint {path}: saved with {index0['num_stages']} stage(s) {index0['parts']}, "
              f"loading into {module.num_stages} stage(s) {module.parts} layer by layer")
    return _load_repartitioned(engine, path, LoadOptions(**flags))


def _load_repartitioned(engine, path: str, options: LoadOptions):
    module = engine.module
    model_repr = module._model_repr()
    weights_only = engine.config.checkpoint.weights_only

    def read():
        shared = ckpt.load_file(os.path.join(path, ckpt.model_file(0)), weights_only)
        saved_dp = int(shared.get("world_size", 1))
        own = {} if options.load_module_only else \
            ckpt.load_file(os.path.join(path, ckpt.optim_file(min(engine.context.rank, saved_dp - 1), 0)), weights_only)
        layers = {}
        for idx, _layer in module.local_layer_modules():
            weights = ckpt.load_file(os.path.join(path, layer_file_name(idx, model_repr)), weights_only)
            optim = None
            if options.load_optimizer_states and not options.load_module_only:
                optim = ckpt.load_file(os.path.join(path, optim_file_name(idx, model_repr)), weights_only)
            layers[idx] = (weights, optim)
        return shared, own, saved_dp, layers

    shared, own, saved_dp, layers = _agree("reading", read)
    stage = engine.stage
    for idx, layer in module.local_layer_modules():
        weights, _optim = layers[idx]
        if options.custom_load_fn is not None:
            options.custom_load_fn(src=weights, dst=layer)
        else:
            layer.load_state_dict(weights, strict=options.load_module_strict)
    optimizer_loaded = False
    if not options.load_module_only and options.load_optimizer_states and engine.basic_optimizer is not None:
        _materialize_optimizer_state(engine.basic_optimizer, any(o for _w, o in layers.values()))
        for idx, layer in module.local_layer_modules():
            _load_layer_optimizer_state(engine, layer, layers[idx][1] or {})
        groups = shared.get("pipe", {}).get("optimizer_param_groups") or []
        for group, saved in zip(engine.basic_optimizer.param_groups, groups):
            group.update(saved)
        optimizer_loaded = True
    if not optimizer_loaded:
        stage.refresh_master_from_model()
    # every other part (counters, scheduler, precision, client state ...) as the engine loads it
    view = CheckpointView(model={k: v for k, v in shared.items() if k not in ("module", "optimizer")}, rank=own,
                          saved_world_size=saved_dp,
                          read_rank=lambda r: ckpt.load_file(os.path.join(path, ckpt.optim_file(r, 0)), weights_only),
                          options=options, path=path)
    engine.events.subset_hook_caller("dsplug_load_checkpoint_state", remove_plugins=[stage])(
        engine=engine, checkpoint=view)
    return path, shared.get("client_state", {})


def _materialize_optimizer_state(optimizer, needed: bool) -> None:
    """An optimizer creates its state at its first step: take one on zero gradients and put every
    tensor it steps back as it was, so the state entries exist to be overwritten."""
    if not needed or optimizer.state:
        return
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [p.detach().clone() for p in tensors]
    grads = [p.grad for p in tensors]
    for p in tensors:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, value in zip(tensors, saved):
            p.copy_(value)
    for p, g in zip(tensors, grads):
        p.grad = g


def _load_layer_optimizer_state(engine, layer, saved: Dict[str, Any]) -> None:
    stage, optimizer = engine.stage, engine.basic_optimizer
    for name, p in layer.named_parameters():
        entry = saved.get(name)
        if entry is None:
            continue
        for key, value in entry["state"].items():
            if _elementwise(value, p):
                stage.set_full_optimizer_state(p, key, value.to(p.device))
            else:  # a per-step scalar: every optimizer entry holds it
                for state in optimizer.state.values():
                    if key in state and torch.is_tensor(state[key]) and torch.is_tensor(value):
                        state[key].copy_(value)
                    else:
                        state[key] = value.clone() if torch.is_tensor(value) else value
        stage.set_full_fp32_param(p, entry["fp32"].to(p.device))
