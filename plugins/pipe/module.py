"""``PipelineModule``: a model written as a sequence of layers, each rank building only the layers
of its pipeline stage.

The forward pass is implicitly ``x = layer(x)`` over the layers in order (like
``torch.nn.Sequential``); a layer's output is the next one's input (a tensor or a tuple of
tensors). Layers are given as:

* :class:`LayerSpec` ``(typename, *args, **kwargs)`` -- built (``typename(*args, **kwargs)``) only
  on the stage that owns it, so no rank ever holds the whole model;
* :class:`TiedLayerSpec` ``(key, typename, *args, forward_fn=None, tied_weight_attr='weight',
  **kwargs)`` -- one module per ``key`` on every stage that uses it (e.g. the input embedding on
  the first stage and the output head on the last); the parameters named by ``tied_weight_attr``
  are the same weights everywhere: broadcast from the lowest stage at construction, their
  gradients summed over those stages before every step (:meth:`allreduce_tied_weight_gradients`,
  or the pipeline engine's own reduction), so they stay identical after every update.
  ``forward_fn(module, x)`` replaces ``module(x)`` (the head multiplying by the embedding matrix);
* an ``nn.Module`` instance (kept only by its owning stage) or any other callable (a function
  without parameters, e.g. a reshape).

``partition_method`` decides the stage boundaries (:mod:`.partition`): ``'parameters'`` balances
trainable parameter counts (a LayerSpec is counted by building it on the ``meta`` device),
``'uniform'`` balances layer counts, ``'type:REGEX'`` balances the number of layers whose class
name matches ``REGEX`` (case-insensitive; a LayerSpec's class, a module's class, a function's
name).

Checkpoint files (DeepSpeed's names): each layer that is a module has
``layer_{idx:02d}-model_states.pt`` with its ``state_dict()`` (``layer_{idx:02d}-model_{mm:02d}-
model_states.pt`` when the topology has a model axis), written by the stage's first data-parallel
rank, so the files do not depend on the number of stages and reload at another stage count.
"""
from __future__ import annotations

import os
import random
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from . import partition as part
from .topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class PipelineError(Exception):
    """Errors related to the use of pipeline parallelism (DeepSpeed's ``PipelineError``)."""


def checkpoint(function, *args):
    """The default ``activation_checkpoint_func``: DeepSpeed's ``deepspeed.checkpointing.checkpoint``,
    asked of the plugin that provides it (hook ``dsplug_activation_checkpoint_function``: the
    activation checkpointing plugin) when called."""
    from dsplug.registry import get_registry

    provided = get_registry().pm.hook.dsplug_activation_checkpoint_function()
    if provided is None:
        raise PipelineError("activation_checkpoint_interval > 0 needs an activation checkpointing function and no "
                            "installed plugin provides one (the activation checkpointing plugin is blocked or not "
                            "installed); pass activation_checkpoint_func= to PipelineModule")
    return provided(function, *args)


class LayerSpec:
    """Builds ``typename(*module_args, **module_kwargs)`` when :meth:`build` is called (on the stage
    that owns the layer only)."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise PipelineError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every layer with the same ``key``."""

    def __init__(self, key: str, typename, *module_args, forward_fn: Optional[Callable] = None,
                 tied_weight_attr="weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise PipelineError(f"TiedLayerSpec {key!r}: tied_weight_attr must be a parameter name or a list of them, "
                                f"got {tied_weight_attr!r}")
        self.tied_weight_attr = attrs


def _set_seed(seed: int, seed_fn: Optional[Callable]) -> None:
    if seed_fn is not None:
        seed_fn(seed)
        return
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import sys

        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(seed % 2 ** 32)
    except Exception:  # noqa: BLE001 - numpy's seed is a courtesy
        pass


def _layer_name(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _count_params(layer) -> int:
    """Trainable parameters of a layer; a LayerSpec is built on the meta device to count them."""
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # noqa: BLE001 - a layer that cannot be built on meta is built for real
            state = torch.random.get_rng_state()
            module = layer.build()
            torch.random.set_rng_state(state)
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    return 0


def partition_layers(layers: Sequence[Any], num_stages: int, method: str = "parameters") -> List[int]:
    """The stage boundaries (``num_stages + 1`` of them) of ``layers`` by ``method``: ``'parameters'``,
    ``'uniform'`` or ``'type:REGEX'`` (see the module docstring)."""
    if not isinstance(method, str):
        raise PipelineError(f"PipelineModule: partition_method must be a string, got {method!r}")
    low = method.lower()
    if low == "uniform":
        return part.partition_uniform(len(layers), num_stages)
    if low == "parameters":
        return part.partition_balanced([_count_params(l) for l in layers], num_stages)
    if low.startswith("type:"):
        pattern = method.split(":", 1)[1]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise PipelineError(f"PipelineModule: partition_method {method!r}: bad regular expression: {exc}") from None
        marks = [1 if regex.search(_layer_name(l)) else 0 for l in layers]
        if not any(marks):
            names = sorted({_layer_name(l) for l in layers})
            raise PipelineError(f"PipelineModule: partition_method {method!r} matches no layer (layer classes: "
                                f"{', '.join(names)})")
        return part.partition_balanced(marks, num_stages)
    raise PipelineError(f"PipelineModule: partition_method {method!r} is not supported; use 'parameters', 'uniform' "
                        "or 'type:REGEX' ('profile' is not available in dsplug)")


class PipelineModule(nn.Module):
    """A sequence of layers split over pipeline stages; this rank holds its stage's layers only.

    ``num_stages`` or ``topology`` (a :class:`ProcessTopology` with a ``pipe`` and a ``data`` axis)
    must be given; with ``num_stages`` alone the topology is ``PipeDataParallelTopology(num_stages,
    world_size // num_stages)``. ``loss_fn(outputs, labels)`` makes the last stage compute the loss
    (without it the last layer's output is the loss). ``seed_layers``: each layer is built after
    seeding with ``base_seed + layer_index`` (``seed_fn(seed)`` instead of torch's / python's
    seeds when given) and, in training, each layer's forward is seeded with
    ``base_seed * (micro_offset + 1) + layer_index``, so initial weights and dropout masks do not
    depend on the number of stages. ``activation_checkpoint_interval`` > 0 runs the stage's layers
    in chunks of that many layers under ``activation_checkpoint_func`` while training (a chunk is
    checkpointed when it has parameters, or -- given ``checkpointable_layers``, a list of class
    names -- when all its layers' classes are listed). ``dynamic_shape``: activations may change
    shape between micro-batches, so each is described to the next stage before it is sent
    (:mod:`.p2p`); otherwise only the first one is.
    """

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Optional[ProcessTopology] = None, loss_fn: Optional[Callable] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable] = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpoint, checkpointable_layers=None,
                 dynamic_shape: bool = False):
        super().__init__()
        from dsplug import comm

        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule: give num_stages or topology")
        if isinstance(layers, nn.Sequential):
            layers = list(layers.children())
        layers = list(layers)
        if int(activation_checkpoint_interval) < 0:
            raise PipelineError(f"PipelineModule: activation_checkpoint_interval must be >= 0, got "
                                f"{activation_checkpoint_interval}")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise PipelineError(f"PipelineModule: layer {i} ({layer!r}) is not a LayerSpec, TiedLayerSpec, "
                                    "torch.nn.Module or callable")
        comm.init_distributed(verbose=False)
        self.world_size = comm.get_world_size()
        self.global_rank = comm.get_rank()
        if topology is None:
            num_stages = int(num_stages)
            if num_stages < 1 or self.world_size % num_stages:
                raise PipelineError(f"PipelineModule: num_stages={num_stages} must divide the world size "
                                    f"{self.world_size} (the rest is data parallelism)")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        elif num_stages is not None and int(num_stages) != topology.get_dim("pipe"):
            raise PipelineError(f"PipelineModule: num_stages={num_stages} but the topology's pipe axis has "
                                f"{topology.get_dim('pipe')} stages")
        self._topo = topology
        self._grid = PipelineParallelGrid(topology=topology)
        self.num_stages = self._topo.get_dim("pipe")
        self.stage_id = self._grid.get_stage_id()

        self._layer_specs = layers
        self._num_layers = len(layers)
        self.loss_fn = loss_fn
        self.seed_layers = bool(seed_layers)
        self.seed_fn = seed_fn
        self.base_seed = int(base_seed)
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None
        self.dynamic_shape = bool(dynamic_shape)
        self.micro_offset = 0

        self.parts = self._partition(partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.forward_funcs: List[Callable] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: Dict[str, List[str]] = {}
        self._build()
        from dsplug.accelerator import get_accelerator

        accelerator = get_accelerator()
        self.to(accelerator.training_device(comm.get_local_rank()))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # ------------------------------------------------------------------ partitioning
    def _partition(self, method: str) -> List[int]:
        return partition_layers(self._layer_specs, self.num_stages, method)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise PipelineError(f"layer {layer_idx} does not exist (the module has {self._num_layers} layers)")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise AssertionError("unreachable: the partition covers every layer")

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                _set_seed(self.base_seed + idx, self.seed_fn)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                    for attr in layer.tied_weight_attr:
                        if not isinstance(getattr(self.tied_modules[layer.key], attr, None), nn.Parameter):
                            raise PipelineError(f"TiedLayerSpec {layer.key!r}: {layer.typename.__name__} has no "
                                                f"parameter {attr!r} (tied_weight_attr)")
                elif self.tied_weight_attrs[layer.key] != layer.tied_weight_attr:
                    raise PipelineError(f"TiedLayerSpec {layer.key!r}: tied_weight_attr differs between its layers "
                                        f"({self.tied_weight_attrs[layer.key]} vs {layer.tied_weight_attr})")
                self.forward_funcs.append(_TiedCall(self.tied_modules, layer.key, layer.forward_fn))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)
        # every module parameter of the stage must be trainable by the engine as an ordinary module
        for name, p in self.named_parameters():
            if not p.is_leaf:
                raise PipelineError(f"PipelineModule: parameter {name} is not a leaf tensor")

    def local_layers(self) -> List[int]:
        """The global indices of this stage's layers."""
        return list(range(self._local_start, self._local_stop))

    # ------------------------------------------------------------------ tied weights
    def _tied_keys(self) -> Dict[str, List[int]]:
        """key -> the stages that hold a layer with that key (sorted)."""
        stages: Dict[str, set] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(idx))
        return {k: sorted(v) for k, v in stages.items()}

    def _index_tied_modules(self) -> Dict[str, dict]:
        """For every tie key: the ranks of the stages sharing it (with this rank's other
        coordinates) and their process group. Every rank creates every such group, in key order."""
        tied: Dict[str, dict] = {}
        other_axes = [a for a in self._topo.axes if a != "pipe"]
        from itertools import product

        for key, stages in sorted(self._tied_keys().items()):
            if len(stages) < 2:
                continue
            for values in product(*(range(self._topo.get_dim(a)) for a in other_axes)):
                fixed = dict(zip(other_axes, values))
                ranks = [self._topo.get_rank(pipe=s, **fixed) for s in stages]
                group = self._grid.groups.get(ranks)
                if self.global_rank in ranks:
                    tied[key] = {"ranks": ranks, "group": group, "stages": stages,
                                 "weight_attr": self.tied_weight_attrs[key]}
        return tied

    def tied_parameters(self) -> List[tuple]:
        """``(key, attribute, parameter, group)`` of this stage's tied weights shared with another stage."""
        out = []
        for key, info in sorted(self.tied_comms.items()):
            module = self.tied_modules[key]
            for attr in info["weight_attr"]:
                out.append((key, attr, getattr(module, attr), info["group"]))
        return out

    def get_tied_weights_and_groups(self) -> List[tuple]:
        """DeepSpeed's ``(weight, group)`` pairs of the tied weights this stage shares."""
        return [(p, group) for _k, _a, p, group in self.tied_parameters()]

    def _synchronize_tied_weights(self) -> None:
        from dsplug import comm

        with torch.no_grad():
            for key, _attr, p, group in self.tied_parameters():
                src = self.tied_comms[key]["ranks"][0]  # the lowest stage's rank
                comm.broadcast(p.data, src=src, group=group)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the ``.grad`` of every tied weight over the stages that share it."""
        from dsplug import comm

        for _key, _attr, p, group in self.tied_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, group=group)

    # ------------------------------------------------------------------ forward
    def _is_checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers or
                       (isinstance(f, _TiedCall) and type(f.module).__name__ in self.checkpointable_layers)
                       for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, (nn.Module, _TiedCall)))

    def _run_range(self, start: int, end: int):
        local_offset = self.micro_offset

        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for i in range(start, end):
                if self.seed_layers and self.training:
                    _set_seed(self.base_seed * (local_offset + 1) + self._local_start + i, self.seed_fn)
                x = self.forward_funcs[i](x)
            return x

        return run

    def forward(self, forward_input):
        """Run this stage's layers on ``forward_input`` (a tensor or a tuple of tensors)."""
        self.micro_offset += 1
        count = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not (self.training and torch.is_grad_enabled()):
            return self._run_range(0, count)(forward_input)
        x = forward_input
        for start in range(0, count, interval):
            end = min(start + interval, count)
            funcs = self.forward_funcs[start:end]
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(funcs):
                x = self.activation_checkpoint_func(self._run_range(start, end), *args)
            else:
                x = self._run_range(start, end)(*args)
        return x

    # ------------------------------------------------------------------ accessors
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    # ------------------------------------------------------------------ checkpoint files
    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """The file of this stage's ``local_layer_idx``-th layer in ``ckpt_dir``."""
        idx = self._local_start + local_layer_idx
        return os.path.join(ckpt_dir, layer_file_name(idx, self._model_repr()))

    def _model_repr(self) -> str:
        return self._topo.get_rank_repr(self.global_rank, omit_axes=("data", "pipe"))

    def local_layer_modules(self) -> List[tuple]:
        """``(global index, module)`` of this stage's layers that are modules (the tied module for a
        tied layer)."""
        out = []
        for i, f in enumerate(self.forward_funcs):
            module = f.module if isinstance(f, _TiedCall) else f
            if isinstance(module, nn.Module):
                out.append((self._local_start + i, module))
        return out

    def layer_state_dicts(self, exclude_frozen_params: bool = False) -> Dict[str, Dict[str, Any]]:
        """``{layer file name: state dict}`` of this stage's layers (detached copies; frozen
        parameters left out with ``exclude_frozen_params``)."""
        out = {}
        for idx, module in self.local_layer_modules():
            state = module.state_dict()
            if exclude_frozen_params:
                frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            out[layer_file_name(idx, self._model_repr())] = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
        return out

    def save_state_dict(self, save_dir: str, checkpoint_engine=None, exclude_frozen_params: bool = False) -> Dict:
        """Write ``layer_XX-model_states.pt`` for this stage's layers into ``save_dir`` (the stage's
        first data-parallel rank writes; the others return at once). Returns ``{file: manifest
        entry}`` of the files written. (DeepSpeed's method; the engine's checkpoints write these
        files through the checkpoint hooks instead, listed in the tag's manifest.)"""
        from dsplug import checkpoint as ckpt

        if self._grid.data_parallel_id != 0:
            return {}
        os.makedirs(save_dir, exist_ok=True)
        return {name: ckpt.atomic_save(state, os.path.join(save_dir, name))
                for name, state in self.layer_state_dicts(exclude_frozen_params).items()}

    def load_state_dir(self, load_dir: str, checkpoint_engine=None, strict: bool = True) -> None:
        """Load this stage's layers from their ``layer_XX-model_states.pt`` files in ``load_dir``
        (each checked against the directory's ``manifest.json`` when it has one)."""
        from dsplug import checkpoint as ckpt

        for idx, module in self.local_layer_modules():
            name = layer_file_name(idx, self._model_repr())
            module.load_state_dict(ckpt.load_file(os.path.join(load_dir, name)), strict=strict)


def layer_file_name(idx: int, model_repr: str = "") -> str:
    """DeepSpeed's name of layer ``idx``'s checkpoint file."""
    return f"layer_{idx:02d}-{model_repr}-model_states.pt" if model_repr else f"layer_{idx:02d}-model_states.pt"


class _TiedCall:
    """Calls a tied module (looked up by key, so it is the stage's one instance), through
    ``forward_fn(module, x)`` when given."""

    def __init__(self, modules: nn.ModuleDict, key: str, forward_fn: Optional[Callable]):
        self._modules = modules
        self.key = key
        self.forward_fn = forward_fn

    @property
    def module(self) -> nn.Module:
        return self._modules[self.key]

    def parameters(self):
        return self.module.parameters()

    def __call__(self, x):
        if self.forward_fn is not None:
            return self.forward_fn(self.module, x)
        return self.module(x)
