"""What the four pruning methods share: a mask per layer that follows the schedule, and the
physical removal of what it zeroed (``redundancy_clean``).

Methods (``shared_parameters.method``):

* ``l1`` (static, magnitude): at ``schedule_offset`` the mask keeps the ``dense_ratio`` share of
  weights / rows / heads / channels of largest magnitude (L1 norm), taken once from the weights
  of that step, and stays fixed;
* ``topk`` (dynamic, learnable): a score per weight / row / head / channel, initialised to the
  same magnitudes and trained with the model through a straight-through top-k; from
  ``schedule_offset`` on the mask keeps the top ``dense_ratio`` share of scores at every forward.

Kept counts are ``round(dense_ratio * n)`` (at least 1; :func:`~.masks.kept_count`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from . import shrink
from .layers import CompressedLayer, Pruning, compressed
from .method import ScheduledMethod, CompressionTarget
from .selection import CompressionConfigError


class MaskPruning(ScheduledMethod):
    clean_order = 2

    def num_heads(self) -> int:
        return 0

    def attach(self, target: CompressionTarget) -> None:
        target.layer.add_pruning(self.kind, self.shared.method, target.group.params.dense_ratio, self.num_heads())

    def apply_schedule(self, step: int, starting: bool = False, resumed: bool = False) -> None:
        active = step >= self.shared.schedule_offset
        for target in self.targets:
            state = target.layer.pruning[self.kind]
            if active and not state.active and not resumed and state.method != "topk":
                state.refresh = True  # the magnitude mask is taken at the next forward (weights gathered there)
            state.active = active

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        # a mask due at the next forward when the checkpoint was taken is taken after the resume too
        state["refresh_pending"] = [t.name for t in self.targets if t.layer.pruning[self.kind].refresh]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        pending = set(state.get("refresh_pending", ()))
        for target in self.targets:
            target.layer.pruning[self.kind].refresh = target.name in pending

    # -- redundancy_clean
    def final_mask(self, layer: CompressedLayer) -> Optional[torch.Tensor]:
        """The mask the layer applies now (None when the method never activated)."""
        state = layer.pruning.get(self.kind)
        if state is None or not state.active:
            return None
        with torch.no_grad():
            return layer.current_mask(self.kind).detach().float()

    def clean(self, model: nn.Module) -> nn.Module:
        for target in self.targets:
            layer = model.get_submodule(target.name)
            mask = self.final_mask(layer) if isinstance(layer, CompressedLayer) else None
            if mask is not None:
                self.remove_pruned(model, target, layer, mask)
            else:
                drop_pruning(model.get_submodule(target.name), self.kind)
        return model

    def remove_pruned(self, model: nn.Module, target: CompressionTarget, layer: CompressedLayer,
                      mask: torch.Tensor) -> None:
        """Rows / channels: the layer loses its pruned outputs, each related module the same inputs."""
        keep = shrink.keep_indices(mask)
        smaller = (shrink.shrink_conv_out if isinstance(layer, nn.Conv2d) else shrink.shrink_linear_out)(layer, keep)
        shrink.replace_module(model, target.name, carry_state(layer, smaller, self.kind, out_keep=keep))
        for name in target.related:
            shrink_related_inputs(model, name, keep, f"{self.path}.different_groups.{target.group_name}")


def drop_pruning(layer: nn.Module, kind: str) -> None:
    if isinstance(layer, CompressedLayer) and kind in layer.pruning:
        del layer.pruning[kind]
        layer._buffers.pop(f"{kind}_mask", None)
        layer._parameters.pop(f"{kind}_scores", None)


def carry_state(old: nn.Module, new: nn.Module, cleaned: str, out_keep=None, in_keep=None) -> nn.Module:
    """``new`` (a shrunk copy of ``old``) keeps ``old``'s remaining compression state, masks and
    scores indexed to the kept outputs / inputs (``cleaned``'s own state is dropped)."""
    if not isinstance(old, CompressedLayer):
        return new
    layer = compressed(new)
    layer.weight_quant = old.weight_quant
    if old.activation_quant is not None:
        quant = old.activation_quant
        layer.add_activation_quant(quant.bits, quant.symmetric, quant.dynamic).active = quant.active
        layer.activation_range.copy_(old.activation_range)
        layer.activation_range_seen.copy_(old.activation_range_seen)
    for kind, state in old.pruning.items():
        if kind == cleaned:
            continue
        if kind == "sparse_pruning" or (in_keep is not None and kind == "head_pruning"):
            raise CompressionConfigError(
                f"redundancy_clean: a layer with pending {kind} cannot also lose {cleaned.split('_')[0]}s "
                f"(clean {kind} first)")
        mask = getattr(old, f"{kind}_mask")
        scores = getattr(old, f"{kind}_scores", None)
        if out_keep is not None and kind != "head_pruning":
            mask = mask.index_select(0, out_keep)
            scores = scores.index_select(0, out_keep) if scores is not None else None
        copy = Pruning(kind, state.method, state.dense_ratio, state.num_heads)
        copy.active, copy.refresh = state.active, state.refresh
        layer.pruning[kind] = copy
        layer.register_buffer(f"{kind}_mask", mask.clone())
        if scores is not None:
            layer.register_parameter(f"{kind}_scores", nn.Parameter(scores.detach().clone()))
    return layer


def shrink_related_inputs(model: nn.Module, name: str, keep: torch.Tensor, path: str) -> None:
    """The related module ``name`` keeps only the inputs ``keep`` (Linear / Conv2d / BatchNorm2d)."""
    module = model.get_submodule(name)
    try:
        smaller = shrink.related_shrink(module, keep)
    except (TypeError, ValueError) as exc:
        raise CompressionConfigError(f"{path}.related_modules: {name!r}: {exc}") from None
    shrink.replace_module(model, name, carry_state(module, smaller, "", in_keep=keep))
