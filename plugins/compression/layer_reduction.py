"""``compression_training.layer_reduction``: a shallower student initialised from teacher layers.

The layers are the children of the ``nn.ModuleList`` / ``nn.Sequential`` at
``module_name_prefix``. Student layer ``i`` becomes a copy of teacher layer ``teacher_layer[i]``,
and every module named in ``other_module_name`` (embeddings, pooler, classifier) is copied from
the teacher's module of the same name:

* ``init_compression(student, config, teacher_model=teacher)``: the student must have
  ``keep_number_layer`` layers (or the teacher's count, which is then cut to the kept ones);
  weights are copied from the teacher exactly;
* without a teacher (what the engine does from the config alone): the model is its own teacher --
  its layer list is cut to the layers ``teacher_layer`` names, in that order; a model that already
  has ``keep_number_layer`` layers (``init_compression`` made it the student) is left as it is.

A Hugging Face model's ``config.num_hidden_layers`` follows the new depth.
"""
from __future__ import annotations

import copy
from typing import Optional

from torch import nn

from dsplug.contracts import CompressionMethod

from .config import LayerReductionConfig
from .selection import CompressionConfigError

PATH = "compression_training.layer_reduction"


def _layers(model: nn.Module, prefix: str, what: str) -> nn.Module:
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        raise CompressionConfigError(f"{PATH}.module_name_prefix: the {what} has no module {prefix!r}") from None
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise CompressionConfigError(f"{PATH}.module_name_prefix: {prefix!r} of the {what} is a "
                                     f"{type(layers).__name__}, not a ModuleList / Sequential of layers")
    return layers


def student_initialization(student: nn.Module, teacher: Optional[nn.Module], config: LayerReductionConfig) -> nn.Module:
    """Cut ``student``'s layers to the kept ones and copy the chosen teacher layers into them."""
    layers = _layers(student, config.module_name_prefix, "model")
    if teacher is None and len(layers) == config.keep_number_layer:
        return student  # already the student's depth (init_compression reduced it, or it was built so)
    source = _layers(teacher, config.module_name_prefix, "teacher model") if teacher is not None else layers
    for index in config.teacher_layer:
        if index >= len(source):
            raise CompressionConfigError(f"{PATH}.teacher_layer: layer {index} does not exist; the "
                                         f"{'teacher ' if teacher is not None else ''}model has {len(source)} layers "
                                         f"under {config.module_name_prefix!r}")
    keep = config.keep_number_layer
    if len(layers) != keep:
        if teacher is not None and len(layers) != len(source):
            raise CompressionConfigError(f"{PATH}.keep_number_layer: the student has {len(layers)} layers under "
                                         f"{config.module_name_prefix!r}; it needs {keep} (or the teacher's "
                                         f"{len(source)}, cut to the kept ones)")
        kept = [layers[i] for i in config.teacher_layer]
        replacement = type(layers)(*kept) if isinstance(layers, nn.Sequential) else nn.ModuleList(kept)
        _replace(student, config.module_name_prefix, replacement)
        layers = replacement
    if teacher is not None:
        for i, index in enumerate(config.teacher_layer):
            layers[i].load_state_dict(copy.deepcopy(source[index].state_dict()))
        for name in config.other_module_name:
            try:
                target, origin = student.get_submodule(name), teacher.get_submodule(name)
            except AttributeError:
                raise CompressionConfigError(f"{PATH}.other_module_name: {name!r} is not a module of both the "
                                             f"student and the teacher model") from None
            target.load_state_dict(copy.deepcopy(origin.state_dict()))
    hf_config = getattr(student, "config", None)
    if hf_config is not None and hasattr(hf_config, "num_hidden_layers") and hasattr(hf_config, "to_dict"):
        hf_config.num_hidden_layers = keep
    return student


def _replace(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


class LayerReduction(CompressionMethod):
    name = "layer_reduction"
    clean_order = 3

    def __init__(self, config, context=None, teacher_model: Optional[nn.Module] = None):
        super().__init__(config, context)
        self.teacher_model = teacher_model

    def compress(self, model: nn.Module) -> nn.Module:
        if not self.config.enabled:
            return model
        return student_initialization(model, self.teacher_model, self.config)


def build(config: LayerReductionConfig, context) -> LayerReduction:
    return LayerReduction(config, context)
