"""DeepSpeed's compression API: ``dsplug.compression.compress`` (``deepspeed.compression.compress``).

* :func:`init_compression` applies every method of the config's ``compression_training`` to the
  model (layer reduction first, then the layer methods) and returns it; ``dsplug.initialize``
  with the same config continues from there (it applies the methods again, which adopts the
  layers already converted) and runs their schedules step by step.
* :func:`redundancy_clean` returns the physically smaller model after training: quantized
  weights baked in, sparse masks multiplied in, pruned rows / heads / channels removed with the
  matching inputs of the related layers. It uses the methods the engine trained with (their
  step and masks); a method whose schedule never started (``schedule_offset`` not reached, or a
  model no engine trained) cleans as if its schedule had run to its end (masks taken from the
  current weights and scores).

  Under ZeRO stage 3 the parameters are gathered for the clean: the shrunk layers come out as
  ordinary whole modules, the others stay partitioned (the engine's forward still gathers them).
  The cleaned model is for evaluation and export (``engine.save_16bit_model``, a state dict);
  training it further needs a new engine.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn

from dsplug.context import BuildContext

from .layer_reduction import LayerReduction, student_initialization as _student_initialization
from .layers import CompressedLayer, make_plain
from .method import METHODS_ATTRIBUTE, ScheduledMethod, gathered
from .selection import CompressionConfigError

def _config(deepspeed_config):
    from dsplug.config import DsplugConfig

    if isinstance(deepspeed_config, DsplugConfig):
        return deepspeed_config
    return DsplugConfig(deepspeed_config)


def _context(config) -> BuildContext:
    from dsplug import comm

    ready = comm.is_initialized()
    return BuildContext(config=config, comm=comm, rank=comm.get_rank() if ready else 0,
                        world_size=comm.get_world_size() if ready else 1)


def _check_mpu(mpu) -> None:
    if mpu is not None and mpu.get_model_parallel_world_size() > 1:
        raise CompressionConfigError("compression with model (tensor) parallelism is not available in dsplug: the "
                                     f"mpu has a model-parallel world size of {mpu.get_model_parallel_world_size()}")


def build_methods(config, context=None) -> List[Any]:
    """The configured methods, in the order they apply (layer reduction first)."""
    config = _config(config)
    context = context or _context(config)
    methods = []
    for provided, section in sorted(config.compression, key=lambda ps: -ps[0].spec.priority):
        method = provided.spec.factory(section, context)
        if method is not None:
            method.name = provided.name
            methods.append(method)
    return methods


def init_compression(model: nn.Module, deepspeed_config, teacher_model: Optional[nn.Module] = None, mpu=None):
    """Apply the config's ``compression_training`` methods to ``model``; returns the model."""
    _check_mpu(mpu)
    methods = build_methods(deepspeed_config)
    for method in methods:
        if isinstance(method, LayerReduction):
            method.teacher_model = teacher_model
        model = method.compress(model)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config, mpu=None) -> nn.Module:
    """The physically smaller model (see the module docstring); changes ``model`` in place."""
    _check_mpu(mpu)
    # ZeRO stage 3: every parameter gathered for the clean; the shrunk layers are new, whole modules,
    # the others are partitioned again (with what the clean wrote into them) when it ends
    with gathered(list(model.parameters()), modify=True, whole_model=True):
        return _clean(model, deepspeed_config)


def _clean(model: nn.Module, deepspeed_config) -> nn.Module:
    trained: Dict[str, Any] = model.__dict__.get(METHODS_ATTRIBUTE, {})
    methods = []
    for method in build_methods(deepspeed_config):
        if method.name in trained:
            method = trained[method.name]
        elif isinstance(method, ScheduledMethod):
            method.compress(model)
        if isinstance(method, ScheduledMethod) and method.step < method.shared.schedule_offset:
            method.on_step(_final_step(method))  # never started: clean as if its schedule had run
        methods.append(method)
    for method in sorted(methods, key=lambda m: getattr(m, "clean_order", 1)):
        model = method.clean(model)
    for module in list(model.modules()):
        if isinstance(module, CompressedLayer) and module.activation_quant is None:
            make_plain(module)
    model.__dict__.pop(METHODS_ATTRIBUTE, None)
    return model


def _final_step(method) -> int:
    shared = method.shared
    return max(shared.schedule_offset, getattr(shared, "schedule_offset_end", None) or 0)


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config) -> nn.Module:
    """Initialise ``student_model``'s layers from ``teacher_model`` (``layer_reduction``)."""
    config = _config(deepspeed_config)
    for provided, section in config.compression:
        if provided.name == "layer_reduction":
            return _student_initialization(student_model, teacher_model, section)
    raise CompressionConfigError("student_initialization: the config has no compression_training.layer_reduction")
