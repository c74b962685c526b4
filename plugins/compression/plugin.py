"""Registers the seven compression methods of ``compression_training`` and DeepSpeed's import paths
``dsplug.compression`` / ``dsplug.compression.compress`` (:mod:`.api`).

Entry point: ``compression = "dsplug.plugins.compression.plugin"``. Each method is a spec of its
own (``DSPLUG_BLOCK_PLUGINS=compression:row_pruning`` blocks one): its schema from :mod:`.config`
and a factory that imports the method's module -- and with it torch -- only when a config
selects the method, so discovery (``dsplug list``, ``--help``, ``config check``) imports no torch.
"""
from __future__ import annotations

import importlib

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from . import config as C


def _method(name: str, schema, summary: str, **spec) -> PluginSpec:
    """The spec of the method implemented by ``build(section, context)`` in the module ``name``."""
    module = f"{__package__}.{name}"

    def build(section, context):
        return importlib.import_module(module).build(section, context)

    # where the method is implemented, as `dsplug config explain` and `dsplug list` show it
    build.__module__, build.__qualname__ = module, "build"
    return PluginSpec(category="compression", name=name, schema=schema, factory=build, summary=summary, **spec)


@hookimpl
def dsplug_compression_methods():
    return [
        # priority: layer reduction runs before the methods that compress layers (they see the kept layers only)
        _method("layer_reduction", C.LayerReductionConfig, priority=10,
                summary="a shallower student initialised from chosen teacher layers"),
        _method("weight_quantization", C.WeightQuantizationConfig, ops=("quantizer",),
                rules=(C.in_step_quantization_needs_low_precision,),
                summary="quantization-aware training of Linear/Conv2d weights (bits scheduled per group)"),
        _method("activation_quantization", C.ActivationQuantizationConfig, ops=("quantizer",),
                summary="quantize the inputs of Linear/Conv2d layers (dynamic or static range)"),
        _method("sparse_pruning", C.SparsePruningConfig,
                summary="weight sparsity: l1 / topk masks or snip_momentum block pruning"),
        _method("row_pruning", C.RowPruningConfig,
                summary="prune output rows of Linear layers (and the related layers' input columns)"),
        _method("head_pruning", C.HeadPruningConfig,
                summary="prune attention heads (output projection columns and q/k/v rows)"),
        _method("channel_pruning", C.ChannelPruningConfig,
                summary="prune output channels of Conv2d layers (and the related layers' inputs)"),
    ]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.compression", "dsplug.plugins.compression.api"),
            ApiModule("dsplug.compression.compress", "dsplug.plugins.compression.api")]
