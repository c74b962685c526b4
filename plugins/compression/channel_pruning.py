"""``compression_training.channel_pruning``: remove output channels of Conv2d layers.

Meant for back-to-back convolutions (a ResNet block): the first Conv2d's output channels are
masked (filters and bias), and ``redundancy_clean`` removes them from it and the matching channels
of each ``related_modules`` layer (the next Conv2d's input channels, a BatchNorm2d's features).
Methods and schedule: :mod:`.pruning`.
"""
from __future__ import annotations

from torch import nn

from .config import ChannelPruningConfig
from .pruning import MaskPruning


class ChannelPruning(MaskPruning):
    kind = "channel_pruning"

    def kinds(self):
        return (nn.Conv2d,)


def build(config: ChannelPruningConfig, context) -> ChannelPruning:
    return ChannelPruning(config, context)
