"""``compression_training.sparse_pruning``: unstructured and block-structured weight sparsity.

* ``l1`` / ``topk`` (see :mod:`.pruning`): an element mask per weight, the ``dense_ratio`` of each
  group kept, from ``schedule_offset`` on.
* ``snip_momentum``: structured, global pruning in ``block_pattern`` blocks ("NxM": N rows x M
  columns; "N:M": N kept of every M inputs) of every Linear / Conv2d layer (all of them unless
  ``different_groups`` names some) minus ``excluded_modules``. From ``schedule_offset`` to
  ``schedule_offset_end`` each layer accumulates the score ``beta * s + (1 - beta) * |w * grad|``
  (:data:`SNIP_BETA`; averaged over ranks before use), and every ``schedule_offset_stride`` steps
  the masks are recomputed across all layers at once at the sparsity of the cubic schedule
  ``(1 - dense_ratio) * (1 - (1 - (t - offset) / (end - offset)) ** 3)``
  (:func:`~.masks.cubic_sparsity`); after ``schedule_offset_end`` the masks stay fixed.

``redundancy_clean`` multiplies the masks into the weights (sparsity does not change shapes).
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from . import masks as mask_ops
from .config import PruningGroup, PruningParams, SparsePruningConfig
from .method import CompressionTarget, gathered
from .pruning import MaskPruning, drop_pruning

#: momentum of the snip_momentum scores
SNIP_BETA = 0.9


class SparsePruning(MaskPruning):
    kind = "sparse_pruning"
    clean_order = 1

    def __init__(self, config, context=None):
        super().__init__(config, context)
        self.scores: Dict[str, torch.Tensor] = {}

    @property
    def snip(self) -> bool:
        return self.shared.method == "snip_momentum"

    def groups(self) -> Dict[str, Any]:
        groups = super().groups()
        if self.snip and not groups:  # every Linear / Conv2d layer but the excluded ones
            groups = {"all": PruningGroup(params=PruningParams(dense_ratio=self.shared.dense_ratio))}
        return groups

    def excluded(self):
        return list(self.shared.excluded_modules)

    def attach(self, target: CompressionTarget) -> None:
        if not self.snip:
            return super().attach(target)
        mask_ops.block_mask({target.name: torch.zeros(target.layer.weight.shape)},
                            self.shared.block_pattern, 0.0)  # the shape fits the pattern, or a clear error
        target.layer.add_pruning(self.kind, "snip_momentum", self.shared.dense_ratio)

    def _accumulator(self, name: str):
        def accumulate(weight, grad):
            self.scores[name] = mask_ops.snip_momentum_scores(self.scores.get(name), weight, grad, beta=SNIP_BETA)
        return accumulate

    def apply_schedule(self, step: int, starting: bool = False, resumed: bool = False) -> None:
        if not self.snip:
            return super().apply_schedule(step, starting, resumed)
        shared = self.shared
        start, end, stride = shared.schedule_offset, shared.schedule_offset_end, shared.schedule_offset_stride
        scoring = start <= step < end
        for target in self.targets:
            target.layer.pruning[self.kind].active = step >= start
            target.layer.snip_hook = self._accumulator(target.name) if scoring else None
        on_stride = step <= end and (step - start) % stride == 0
        if step < start or resumed or not on_stride or len(self.scores) < len(self.targets):
            return
        sparsity = mask_ops.cubic_sparsity(step, start, end, stride, 1.0 - shared.dense_ratio)
        scores = {name: self.world_mean(score.clone()) for name, score in self.scores.items()}
        new_masks = mask_ops.block_mask(scores, shared.block_pattern, sparsity)
        for target in self.targets:
            target.layer.sparse_pruning_mask.copy_(new_masks[target.name])

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if self.snip:
            state["scores"] = {name: score.clone() for name, score in self.scores.items()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scores = {name: score.clone() for name, score in state.get("scores", {}).items()}
        super().load_state_dict(state)

    def clean(self, model):
        """Sparsity keeps shapes: the mask is multiplied into the weight."""
        for target in self.targets:
            layer = model.get_submodule(target.name)
            mask = self.final_mask(layer)
            if mask is not None:
                with torch.no_grad(), gathered([layer.weight], modify=True):
                    layer.weight.data.mul_(mask.to(layer.weight.dtype))
            layer.snip_hook = None
            drop_pruning(layer, self.kind)
        return model


def build(config: SparsePruningConfig, context) -> SparsePruning:
    return SparsePruning(config, context)
