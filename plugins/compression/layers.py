"""Compressed Linear / Conv2d layers: one module carries every compression method applied to it.

A selected ``nn.Linear`` (``nn.Conv2d``) becomes a :class:`CompressedLinear`
(:class:`CompressedConv2d`) by changing its class in place: the module object, its name, its
``weight`` / ``bias`` Parameters and any hooks stay the same, so an optimizer or a ZeRO stage
built over the model still refers to the right tensors, and ``isinstance(m, nn.Linear)`` holds.
Each method then attaches its part (:class:`WeightQuant`, :class:`ActivationQuant`, a pruning
mask), and the forward computes::

    w = weight * sparse_mask * row_mask[:, None] * head_mask[cols] (masks of the active methods)
    w = quantize(w) (mixed with w by fp16_mixed_quantize's ratio)   when weight quantization is on
    x = quantize(x) (per token or within a calibrated range)        when activation quantization is on
    y = linear(x, w, bias * row_mask)

Masks are buffers (``<method>_mask``) registered when the method attaches, so the model's state
dict has the same keys before and after a method activates. ``topk`` methods learn their mask:
their scores are Parameters (``<method>_scores``) trained through a straight-through top-k
(:class:`~.masks.TopKBinarizer`), and the buffer records the latest binarized mask.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dsplug.ops import quantize as quant_ops

from . import masks as mask_ops

#: momentum of the static activation range (an exponential moving average of batch min / max)
STATIC_RANGE_MOMENTUM = 0.95

PRUNING_KINDS = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


class CompressionConfigError(ValueError):
    """A compression setting that does not fit the model (a pattern matching nothing, a bad shape)."""


def check_same(what: str, existing, wanted, names: str) -> None:
    """A layer compressed before (init_compression, an earlier initialize) keeps its settings:
    a config asking for others is an error, not a silent keep."""
    if tuple(existing) != tuple(wanted):
        raise CompressionConfigError(f"the layer already has {what} with ({names}) = {tuple(existing)} from an earlier "
                                     f"init_compression / initialize; this config asks for {tuple(wanted)}. Build the "
                                     f"model again to compress it differently")


class WeightQuant:
    """Weight quantization state of one layer (set by the ``weight_quantization`` method)."""

    def __init__(self, groups: int, symmetric: bool, stochastic: bool, in_forward: bool, generator=None):
        self.bits: Optional[int] = None  # None: not active yet
        self.groups = groups
        self.symmetric = symmetric
        self.stochastic = stochastic
        self.in_forward = in_forward
        self.mix_ratio: Optional[float] = None  # fp16_mixed_quantize: share of the quantized value
        self.generator = generator

    def apply(self, weight: torch.Tensor, straight_through: bool) -> torch.Tensor:
        fn = quant_ops.fake_quantize if straight_through else quant_ops.quantize_dequantize
        quantized = fn(weight, self.bits, groups=self.groups, symmetric=self.symmetric,
                       stochastic=self.stochastic, generator=self.generator)
        if self.mix_ratio is not None and self.mix_ratio < 1.0:
            return (1.0 - self.mix_ratio) * weight + self.mix_ratio * quantized
        return quantized


class ActivationQuant:
    """Input-activation quantization of one layer (set by ``activation_quantization``)."""

    def __init__(self, bits: int, symmetric: bool, dynamic: bool):
        self.bits = bits
        self.symmetric = symmetric
        self.dynamic = dynamic
        self.active = False


class Pruning:
    """One pruning method's mask on one layer: ``dense_ratio``, ``method`` and whether it is active."""

    def __init__(self, kind: str, method: str, dense_ratio: float, num_heads: int = 0):
        self.kind = kind
        self.method = method
        self.dense_ratio = dense_ratio
        self.num_heads = num_heads
        self.active = False
        self.frozen = False  # l1: the mask is taken once, when the method activates
        self.refresh = False  # recompute the mask from the (gathered) weight at the next forward


class CompressedLayer:
    """Mixin of :class:`CompressedLinear` and :class:`CompressedConv2d` (see the module docstring)."""

    weight_quant: Optional[WeightQuant]
    activation_quant: Optional[ActivationQuant]
    pruning: Dict[str, Pruning]

    def _init_compression(self) -> None:
        self.weight_quant = None
        self.activation_quant = None
        self.pruning = {}
        self.snip_hook = None  # callable(weight, grad) set by snip_momentum pruning

    # -- what each method attaches
    def add_pruning(self, kind: str, method: str, dense_ratio: float, num_heads: int = 0) -> Pruning:
        if kind in self.pruning:  # init_compression already attached it (the engine compresses again)
            existing = self.pruning[kind]
            check_same(kind, (existing.method, existing.dense_ratio, existing.num_heads),
                       (method, dense_ratio, num_heads), "method, dense_ratio, num_heads")
            return existing
        size = self.mask_shape(kind, num_heads)
        self.register_buffer(f"{kind}_mask", torch.ones(size, dtype=torch.float32, device=self.weight.device))
        if method == "topk":
            from .method import gathered  # ZeRO stage 3 (zero.Init): the scores start from the whole weight

            with torch.no_grad(), gathered([self.weight]):
                scores = self.initial_scores(kind, num_heads)
            self.register_parameter(f"{kind}_scores", nn.Parameter(scores.to(self.weight.dtype)))
        state = self.pruning[kind] = Pruning(kind, method, dense_ratio, num_heads)
        return state

    def add_activation_quant(self, bits: int, symmetric: bool, dynamic: bool) -> ActivationQuant:
        if self.activation_quant is not None:
            quant = self.activation_quant
            check_same("activation_quantization", (quant.bits, quant.symmetric, quant.dynamic),
                       (bits, symmetric, dynamic), "bits, symmetric, dynamic range")
        else:
            self.activation_quant = ActivationQuant(bits, symmetric, dynamic)
            self.register_buffer("activation_range", torch.zeros(2, dtype=torch.float32, device=self.weight.device))
            self.register_buffer("activation_range_seen", torch.zeros((), dtype=torch.bool,
                                                                      device=self.weight.device))
        return self.activation_quant

    def mask_shape(self, kind: str, num_heads: int):
        shape = tuple(getattr(self.weight, "ds_shape", self.weight.shape))  # ZeRO-3: the whole weight's
        if kind == "sparse_pruning":
            return shape
        if kind in ("row_pruning", "channel_pruning"):
            return (shape[0],)
        if kind == "head_pruning":
            return (num_heads,)
        raise ValueError(f"unknown pruning kind {kind!r} (known: {', '.join(PRUNING_KINDS)})")

    def initial_scores(self, kind: str, num_heads: int) -> torch.Tensor:
        """topk scores start at the magnitudes l1 would rank by, so the first mask equals l1's."""
        weight = self.weight.detach().float()
        if kind == "sparse_pruning":
            return weight.abs()
        if kind in ("row_pruning", "channel_pruning"):
            return weight.abs().flatten(1).sum(1)
        return mask_ops.head_scores_l1(weight, num_heads)

    # -- the forward
    def current_mask(self, kind: str) -> torch.Tensor:
        """The mask of an active pruning method, differentiable w.r.t. topk scores."""
        state = self.pruning[kind]
        buffer = getattr(self, f"{kind}_mask")
        if state.method == "topk":
            mask = mask_ops.topk_binarize(getattr(self, f"{kind}_scores"), state.dense_ratio)
            buffer.copy_(mask.detach())
            return mask
        if state.refresh:
            with torch.no_grad():
                buffer.copy_(self.magnitude_mask(state))
            state.refresh = False
        return buffer

    def magnitude_mask(self, state: Pruning) -> torch.Tensor:
        weight = self.weight.detach().float()
        if state.kind == "sparse_pruning":
            return mask_ops.sparse_l1_mask(weight, state.dense_ratio)
        if state.kind in ("row_pruning", "channel_pruning"):
            return mask_ops.row_l1_mask(weight, state.dense_ratio)
        return mask_ops.head_l1_mask(weight, state.num_heads, state.dense_ratio)

    def effective_weight_and_bias(self, straight_through: bool = True):
        weight, bias = self.weight, self.bias
        for kind, state in self.pruning.items():
            if not state.active:
                continue
            mask = self.current_mask(kind).to(weight.dtype)
            if kind == "sparse_pruning":
                weight = weight * mask
            elif kind in ("row_pruning", "channel_pruning"):
                weight = weight * mask.view(-1, *([1] * (weight.dim() - 1)))
                bias = bias * mask if bias is not None else None
            else:  # head_pruning: the input columns of each head of an attention output projection
                columns = mask.repeat_interleave(weight.shape[1] // state.num_heads)
                weight = weight * columns.view(1, -1, *([1] * (weight.dim() - 2)))
        if self.snip_hook is not None and weight.requires_grad:  # snip_momentum scores |w * grad|
            weight.register_hook(lambda grad, w=weight.detach().clone(): self.snip_hook(w, grad))
        quant = self.weight_quant
        if quant is not None and quant.bits is not None and (quant.in_forward or not straight_through):
            weight = quant.apply(weight, straight_through)
        return weight, bias

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        quant = self.activation_quant
        if quant is None or not quant.active:
            return x
        if quant.dynamic:  # per token (per row of the last dimension)
            return quant_ops.fake_quantize_rows(x, quant.bits, symmetric=quant.symmetric)
        if self.activation_range.dtype != torch.float32:  # the engine cast the model to bf16 / fp16
            self.activation_range = self.activation_range.float()  # keep the moving average in fp32
        if self.training:
            with torch.no_grad():
                batch = torch.stack([x.detach().min(), x.detach().max()]).float()
                if bool(self.activation_range_seen):
                    self.activation_range.mul_(STATIC_RANGE_MOMENTUM).add_(batch, alpha=1 - STATIC_RANGE_MOMENTUM)
                else:
                    self.activation_range.copy_(batch)
                    self.activation_range_seen.fill_(True)
        lo, hi = self.activation_range.tolist()
        return quant_ops.fake_quantize_range(x, quant.bits, lo, hi, symmetric=quant.symmetric)

    def compression_active(self) -> bool:
        return bool(self.pruning) or self.weight_quant is not None or self.activation_quant is not None


class CompressedLinear(CompressedLayer, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight_and_bias()
        return F.linear(self.quantize_input(x), weight, bias)


class CompressedConv2d(CompressedLayer, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight_and_bias()
        return self._conv_forward(self.quantize_input(x), weight, bias)


_COMPRESSED = {nn.Linear: CompressedLinear, nn.Conv2d: CompressedConv2d}
_PLAIN = {v: k for k, v in _COMPRESSED.items()}
COMPRESSIBLE = tuple(_COMPRESSED)


def compressed(module: nn.Module) -> CompressedLayer:
    """``module`` (an ``nn.Linear`` or ``nn.Conv2d``) as a compressed layer, converted in place."""
    if isinstance(module, CompressedLayer):
        return module
    target = _COMPRESSED.get(type(module))
    if target is None:
        raise TypeError(f"{type(module).__name__} cannot be compressed: the compression methods apply to "
                        f"torch.nn.Linear and torch.nn.Conv2d modules (exactly those classes, not subclasses)")
    module.__class__ = target
    module._init_compression()
    return module


def make_plain(module: nn.Module) -> nn.Module:
    """Turn a compressed layer with nothing left to do back into its plain class (in place)."""
    if not isinstance(module, CompressedLayer):
        return module
    for kind in list(module.pruning):
        module._buffers.pop(f"{kind}_mask", None)
        module._parameters.pop(f"{kind}_scores", None)
    for name in ("activation_range", "activation_range_seen"):
        module._buffers.pop(name, None)
    for name in ("weight_quant", "activation_quant", "pruning", "snip_hook"):
        module.__dict__.pop(name, None)
    module.__class__ = _PLAIN[type(module)]
    return module


def copy_activation_quant(source: nn.Module, target: nn.Module) -> nn.Module:
    """``target`` (a freshly shrunk plain layer) keeps ``source``'s activation quantization."""
    quant = getattr(source, "activation_quant", None)
    if quant is None:
        return target
    layer = compressed(target)
    layer.add_activation_quant(quant.bits, quant.symmetric, quant.dynamic).active = quant.active
    layer.activation_range.copy_(source.activation_range)
    layer.activation_range_seen.copy_(source.activation_range_seen)
    return layer
