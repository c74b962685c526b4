"""``compression_training.row_pruning``: remove output rows of Linear layers.

Meant for two back-to-back Linear layers (a transformer's FFN): the first layer's rows (outputs)
are masked -- its weight rows and bias entries -- and ``redundancy_clean`` removes them from it
and the matching input columns from each ``related_modules`` layer. Methods and schedule:
:mod:`.pruning`.
"""
from __future__ import annotations

from torch import nn

from .config import RowPruningConfig
from .pruning import MaskPruning


class RowPruning(MaskPruning):
    kind = "row_pruning"

    def kinds(self):
        return (nn.Linear,)


def build(config: RowPruningConfig, context) -> RowPruning:
    return RowPruning(config, context)
