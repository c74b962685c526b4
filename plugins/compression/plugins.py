"""The entry points of the seven compression methods, one plugin object each (so that each can be
blocked by its entry-point name, ``DSPLUG_BLOCK_PLUGINS=compression-row-pruning``).

A plugin object answers ``dsplug_compression_methods`` with its method's descriptor: the schema
from :mod:`.config` and a factory that imports the method's module -- and with it torch -- when
a config selects the method. Discovering plugins (``dsplug list``, ``--help``, ``config check``)
therefore never imports torch.
"""
from __future__ import annotations

import importlib

from dsplug import PluginSpec, hookimpl

from . import config as C


class CompressionMethodPlugin:
    """One method: ``module`` (under ``dsplug.plugins.compression``) defines ``build(section, context)``."""

    def __init__(self, name: str, module: str, schema, summary: str, **spec):
        self.__name__ = f"{__name__}:{name}"
        self.name, self.schema, self.summary, self.spec = name, schema, summary, spec
        self.module = f"{__package__}.{module}"

        def build(section, context):
            return importlib.import_module(self.module).build(section, context)

        # where the method is implemented, as `dsplug config explain` and `dsplug list` show it
        build.__module__, build.__qualname__ = self.module, "build"
        self.build = build

    @hookimpl
    def dsplug_compression_methods(self):
        return [PluginSpec(category="compression", name=self.name, schema=self.schema, factory=self.build,
                           summary=self.summary, **self.spec)]

    def __repr__(self) -> str:
        return f"<compression method plugin {self.name!r} ({self.module})>"


# priority: layer reduction runs before the methods that compress layers (they see the kept layers only)
layer_reduction = CompressionMethodPlugin(
    "layer_reduction", "layer_reduction", C.LayerReductionConfig, priority=10,
    summary="a shallower student initialised from chosen teacher layers")
weight_quantization = CompressionMethodPlugin(
    "weight_quantization", "weight_quantization", C.WeightQuantizationConfig, ops=("quantizer",),
    rules=(C.in_step_quantization_needs_low_precision,),
    summary="quantization-aware training of Linear/Conv2d weights (bits scheduled per group)")
activation_quantization = CompressionMethodPlugin(
    "activation_quantization", "activation_quantization", C.ActivationQuantizationConfig, ops=("quantizer",),
    summary="quantize the inputs of Linear/Conv2d layers (dynamic or static range)")
sparse_pruning = CompressionMethodPlugin(
    "sparse_pruning", "sparse_pruning", C.SparsePruningConfig,
    summary="weight sparsity: l1 / topk masks or snip_momentum block pruning")
row_pruning = CompressionMethodPlugin(
    "row_pruning", "row_pruning", C.RowPruningConfig,
    summary="prune output rows of Linear layers (and the related layers' input columns)")
head_pruning = CompressionMethodPlugin(
    "head_pruning", "head_pruning", C.HeadPruningConfig,
    summary="prune attention heads (output projection columns and q/k/v rows)")
channel_pruning = CompressionMethodPlugin(
    "channel_pruning", "channel_pruning", C.ChannelPruningConfig,
    summary="prune output channels of Conv2d layers (and the related layers' inputs)")
