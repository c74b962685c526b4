"""``compression_training.head_pruning``: remove attention heads.

Applied to an attention block's output projection (``attention.output.dense`` in BERT,
``attn.proj`` in dsplug's built-in LM): its input columns come in ``num_heads`` blocks, one per
head, and the mask zeroes whole blocks. ``redundancy_clean`` removes the pruned heads' columns
from the output projection and their rows from each ``related_modules`` projection (query, key
and value -- separate, or one fused qkv projection whose rows are q|k|v), then lowers the head
count attribute (``num_attention_heads`` / ``num_heads`` / ``n_heads`` / ``n_head``, and
``all_head_size``) of the module holding them, so the attention reshapes to the heads left.
Methods and schedule: :mod:`.pruning` (``topk`` by default, ``l1`` on per-head L1 norms).
"""
from __future__ import annotations

from torch import nn

from . import shrink
from .config import HeadPruningConfig
from .layers import CompressedLayer
from .method import CompressionTarget
from .pruning import MaskPruning, carry_state
from .selection import CompressionConfigError

HEAD_COUNT_ATTRIBUTES = ("num_attention_heads", "num_heads", "n_heads", "n_head")


class HeadPruning(MaskPruning):
    kind = "head_pruning"

    def kinds(self):
        return (nn.Linear,)

    def num_heads(self) -> int:
        return self.shared.num_heads

    def attach(self, target: CompressionTarget) -> None:
        width = target.layer.in_features
        if width % self.num_heads():
            raise CompressionConfigError(
                f"{self.path}.shared_parameters.num_heads: {self.num_heads()} heads do not divide the "
                f"{width} input features of {target.name!r} (head pruning applies to attention output projections)")
        super().attach(target)

    def remove_pruned(self, model: nn.Module, target: CompressionTarget, layer: CompressedLayer, mask) -> None:
        heads = self.num_heads()
        head_dim = layer.in_features // heads
        smaller = shrink.shrink_linear_heads_in(layer, mask, head_dim)
        shrink.replace_module(model, target.name, carry_state(layer, smaller, self.kind))
        path = f"{self.path}.different_groups.{target.group_name}.related_modules"
        for name in target.related:
            module = model.get_submodule(name)
            if not isinstance(module, nn.Linear) or module.out_features % layer.in_features:
                raise CompressionConfigError(
                    f"{path}: {name!r} ({type(module).__name__}) is not a query/key/value projection of "
                    f"{heads} heads x {head_dim} features (or a fused q|k|v one)")
            stacked = module.out_features // layer.in_features
            new = shrink.shrink_linear_heads_out(module, mask, head_dim, stacked=stacked)
            shrink.replace_module(model, name, carry_state(module, new, ""))
        kept = int(mask.count_nonzero())
        self.update_head_counts(model, target, heads, kept, head_dim)

    @staticmethod
    def update_head_counts(model: nn.Module, target: CompressionTarget, heads: int, kept: int, head_dim: int) -> None:
        """The attention module reshapes to ``kept`` heads: the parents of the q/k/v projections
        (BERT's ``attention.self``) when they carry a head count, else the output projection's
        nearest ancestor that does (the built-in LM's ``attn``)."""
        def ancestors(name):
            parts = name.split(".")
            return [".".join(parts[:depth]) for depth in range(len(parts) - 1, -1, -1)]

        holders = [ancestors(name)[0] for name in target.related] + ancestors(target.name)
        for holder_name in dict.fromkeys(holders):
            holder = model.get_submodule(holder_name) if holder_name else model
            names = [a for a in HEAD_COUNT_ATTRIBUTES if getattr(holder, a, None) == heads]
            for attribute in names:
                setattr(holder, attribute, kept)
            if names and isinstance(getattr(holder, "all_head_size", None), int):
                holder.all_head_size = kept * head_dim
            if names and holder_name in ancestors(target.name):
                return


def build(config: HeadPruningConfig, context) -> HeadPruning:
    return HeadPruning(config, context)
