"""``compression_training.weight_quantization``: quantization-aware training of weights.

Schedule (``k = step - schedule_offset``, from 0 at the offset): before the offset weights are
full precision; then each group's bit width is ``max(target_bits, start_bits - k //
quantization_period)``. With ``fp16_mixed_quantize`` the layer uses ``(1 - r) * w + r * Q(w)``
with ``r = min(1, quantize_change_ratio * (k + 1))``. ``Q`` is :mod:`dsplug.ops.quantize`'s grid
(``quantize_groups`` groups per matrix, symmetric or asymmetric, nearest or stochastic).

Where the quantization happens (``quantize_weight_in_forward``):

* true: the forward uses ``Q(w)`` and gradients pass straight through to ``w`` (any precision);
* false (DeepSpeed's default): the fp16 / bf16 weights themselves are replaced by ``Q(w)`` after
  every optimizer step, while the fp32 master copy keeps the full-precision value -- so it needs
  fp16 or bf16 training; with fp32 weights (the optimizer's own) it is rejected.

``redundancy_clean`` bakes ``Q(w)`` (nearest rounding, the final bit width) into the weights.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict

import torch

from dsplug.ops import quantize as quant_ops
from .config import WeightQuantizationConfig
from .layers import WeightQuant, check_same, make_plain
from .method import ScheduledMethod, CompressionTarget, gathered, is_partitioned
from .selection import CompressionConfigError


def bits_at(step: int, offset: int, start_bits: int, target_bits: int, period: int):
    """The bit width at ``step`` (None before ``offset``)."""
    if step < offset:
        return None
    return max(target_bits, start_bits - (step - offset) // period)


def mix_ratio_at(step: int, offset: int, change_ratio: float) -> float:
    return min(1.0, change_ratio * (step - offset + 1))


def unique_weights(targets):
    """The targets with one entry per weight tensor (a tied weight is quantized once)."""
    seen = set()
    for target in targets:
        if id(target.layer.weight) not in seen:
            seen.add(id(target.layer.weight))
            yield target


class WeightQuantization(ScheduledMethod):
    kind = "weight_quantization"
    clean_order = 0

    def __init__(self, config, context=None):
        super().__init__(config, context)
        shared = self.shared
        if shared.enabled and shared.quantizer_kernel and not quant_ops.native_available():
            raise CompressionConfigError(
                f"{self.path}.shared_parameters.quantizer_kernel: true needs dsplug's native quantizer op, which is "
                f"not available here (see `dsplug report`); set it to false to use the torch implementation "
                f"(same results)")

    def attach(self, target: CompressionTarget) -> None:
        shared = self.shared
        weight = target.layer.weight
        numel = int(getattr(weight, "ds_numel", weight.numel()))  # ZeRO-3: the whole weight's
        if numel % shared.quantize_groups:
            raise CompressionConfigError(
                f"{self.path}.shared_parameters.quantize_groups: {shared.quantize_groups} does not divide the "
                f"{numel} weights of {target.name!r} {tuple(getattr(weight, 'ds_shape', weight.shape))}")
        generator = None
        if shared.rounding == "stochastic":  # the same stream on every rank: seeded from the layer's name
            generator = torch.Generator().manual_seed(zlib.crc32(target.name.encode()))
        settings = (shared.quantize_groups, shared.quantization_type == "symmetric", shared.rounding == "stochastic",
                    shared.quantize_weight_in_forward)
        existing = target.layer.weight_quant
        if existing is None:
            target.layer.weight_quant = WeightQuant(*settings, generator)
        else:
            check_same("weight_quantization", (existing.groups, existing.symmetric, existing.stochastic,
                                               existing.in_forward), settings,
                       "quantize_groups, symmetric, stochastic, quantize_weight_in_forward")

    def apply_schedule(self, step: int, starting: bool = False, resumed: bool = False) -> None:
        shared = self.shared
        changed = []
        for target in self.targets:
            params = target.group.params
            quant = target.layer.weight_quant
            bits = bits_at(step, shared.schedule_offset, params.start_bits, params.target_bits,
                           params.quantization_period)
            if bits != quant.bits:
                changed.append((target.name, bits))
            quant.bits = bits
            quant.mix_ratio = (mix_ratio_at(step, shared.schedule_offset, shared.fp16_mixed_quantize.quantize_change_ratio)
                               if shared.fp16_mixed_quantize.enabled and bits is not None else None)
        if shared.quantize_verbose and changed and getattr(self.context, "rank", 0) == 0:
            for name, bits in changed:
                print(f"[dsplug] weight_quantization step {step}: {name} -> "
                      f"{'full precision' if bits is None else f'{bits} bits'}", flush=True)
        if not shared.quantize_weight_in_forward:  # after a resume too: the loaded weights may be the master's
            self.quantize_weights_in_place()

    def quantize_weights_in_place(self) -> None:
        """quantize_weight_in_forward false: the low-precision weights become ``Q(w)``."""
        for target in unique_weights(self.targets):
            quant = target.layer.weight_quant
            if quant.bits is None:
                continue
            weight = target.layer.weight
            with torch.no_grad(), gathered([weight], modify=True):
                weight.data.copy_(quant.apply(weight.data, straight_through=False))

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["generators"] = {t.name: t.layer.weight_quant.generator.get_state()
                               for t in self.targets if t.layer.weight_quant.generator is not None}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for target in self.targets:
            saved = state.get("generators", {}).get(target.name)
            if saved is not None and target.layer.weight_quant.generator is not None:
                target.layer.weight_quant.generator.set_state(saved)
        super().load_state_dict(state)

    def clean(self, model):
        """Bake the quantized weights in (nearest rounding at the current bit width)."""
        for target in unique_weights(self.targets):
            layer = target.layer
            quant = layer.weight_quant
            if quant is None:
                continue
            if quant.bits is not None:
                weight = layer.weight
                with torch.no_grad(), gathered([weight], modify=True):
                    baked = quant_ops.quantize_dequantize(weight.data, quant.bits, groups=quant.groups,
                                                          symmetric=quant.symmetric)
                    if quant.mix_ratio is not None and quant.mix_ratio < 1.0:
                        baked = (1.0 - quant.mix_ratio) * weight.data + quant.mix_ratio * baked
                    weight.data.copy_(baked)
            layer.weight_quant = None
            if not layer.pruning and layer.activation_quant is None and not is_partitioned([layer.weight]):
                make_plain(layer)
        return model


def build(config: WeightQuantizationConfig, context) -> WeightQuantization:
    return WeightQuantization(config, context)
