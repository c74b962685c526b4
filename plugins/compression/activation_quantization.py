"""``compression_training.activation_quantization``: quantize the inputs of the selected layers.

From ``schedule_offset`` on, each selected Linear / Conv2d quantizes its input to ``bits``
(symmetric or asymmetric) with straight-through gradients. ``range_calibration``:

* ``dynamic``: the range of each token (each row of the last dimension) at every call;
* ``static``: one range per layer, an exponential moving average (momentum
  :data:`~.layers.STATIC_RANGE_MOMENTUM`) of each training batch's min and max, kept in the
  layer's ``activation_range`` buffer (saved with the model) and used as is in eval mode.

``redundancy_clean`` keeps activation quantization on the cleaned layers (it is part of the
function the model computes).
"""
from __future__ import annotations

from .config import ActivationQuantizationConfig
from .method import ScheduledMethod, CompressionTarget


class ActivationQuantization(ScheduledMethod):
    kind = "activation_quantization"
    clean_order = 0

    def attach(self, target: CompressionTarget) -> None:
        shared = self.shared
        target.layer.add_activation_quant(target.group.params.bits, shared.quantization_type == "symmetric",
                                          shared.range_calibration == "dynamic")

    def apply_schedule(self, step: int, starting: bool = False, resumed: bool = False) -> None:
        for target in self.targets:
            target.layer.activation_quant.active = step >= self.shared.schedule_offset


def build(config: ActivationQuantizationConfig, context) -> ActivationQuantization:
    return ActivationQuantization(config, context)
