"""Each compression method passes dsplug.testing's CompressionContract (discovery, config check,
a typo named, compress/clean keep the model callable, on_step per applied step, checkpoint
round trip and exact resume, engine destroy)."""
from __future__ import annotations

import torch
from torch import nn

from dsplug.testing import CompressionContract

ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


def shared(**values):
    return {"enabled": True, **values}


class TestWeightQuantization(CompressionContract):
    plugin_name = "weight_quantization"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1, quantize_weight_in_forward=True, rounding="stochastic"),
               "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 1},
                                           "modules": ["0", "2"]}}}
    steps = 4

    def trace(self, engine):
        return [engine.module[i].weight_quant.bits for i in (0, 2)]


class TestActivationQuantization(CompressionContract):
    plugin_name = "activation_quantization"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1),
               "different_groups": {"aq": {"params": {"bits": 4}, "modules": ["2"]}}}
    steps = 3

    def trace(self, engine):
        return engine.module[2].activation_range.clone()


class TestSparsePruning(CompressionContract):
    plugin_name = "sparse_pruning"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1, method="l1"),
               "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["0"]}}}
    steps = 3

    def trace(self, engine):
        return engine.module[0].sparse_pruning_mask.clone()


class TestRowPruning(CompressionContract):
    plugin_name = "row_pruning"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1, method="topk"),
               "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["0"],
                                           "related_modules": [["2"]]}}}
    steps = 3

    def trace(self, engine):
        return engine.module[0].row_pruning_mask.clone()


class TestHeadPruning(CompressionContract):
    plugin_name = "head_pruning"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1, num_heads=4),
               "different_groups": {"hp": {"params": {"dense_ratio": 0.5}, "modules": ["2"]}}}
    steps = 3

    def trace(self, engine):
        return engine.module[2].head_pruning_mask.clone()


def tiny_conv_model():
    """tiny_batch inputs (8 features) as 2 channels of 2x2 -> Conv2d -> ReLU -> Conv2d -> Linear(8, 4)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (2, 2, 2)), nn.Conv2d(2, 6, 1), nn.ReLU(), nn.Conv2d(6, 2, 1),
                          nn.Flatten(), nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


class TestChannelPruning(CompressionContract):
    plugin_name = "channel_pruning"
    extra_config = ADAM
    section = {"shared_parameters": shared(schedule_offset=1, method="l1"),
               "different_groups": {"cp": {"params": {"dense_ratio": 0.5}, "modules": ["1"],
                                           "related_modules": [["3"]]}}}
    steps = 3

    def model(self):
        return tiny_conv_model()

    def trace(self, engine):
        return engine.module[1].channel_pruning_mask.clone()


class TestLayerReduction(CompressionContract):
    plugin_name = "layer_reduction"
    extra_config = ADAM
    section = {"enabled": True, "keep_number_layer": 1, "module_name_prefix": "layers", "teacher_layer": [1]}
    steps = 2

    def model(self):
        g = torch.Generator().manual_seed(0)
        model = nn.Sequential()
        model.add_module("layers", nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)))
        model.add_module("out", nn.Linear(8, 4))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return model

    def check_trained(self, engine, losses):
        assert len(engine.module.layers) == 1
