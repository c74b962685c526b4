"""What a precision plugin builds: the :class:`dsplug.contracts.Precision` the engine and the ZeRO
stage follow."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import attrs

from dsplug.contracts import Precision


@attrs.define(eq=False)  # identity equality and hashing: pluggy registers it on the engine's event bus
class PrecisionPolicy(Precision):
    """name:            the plugin name (fp32, fp16, bf16, amp)
    model_dtype:     dtype the module's parameters are cast to
    master_weights:  keep fp32 master copies that the optimizer updates
    grad_accum_dtype: dtype gradients accumulate in between micro-steps
    loss_scaler:     a loss scaler (:mod:`.loss_scaler`; fp16, amp with fp16) or None
    autocast_dtype:  dtype for torch.autocast around forward (amp) or None
    device_type:     the device type torch.autocast is entered for
    check_overflow:  skip steps with non-finite gradients even without a loss scaler
                     (bf16 ``check_grad_overflow``)
    """

    name: str
    model_dtype: Any
    master_weights: bool = False
    grad_accum_dtype: Any = None
    loss_scaler: Optional[Any] = None
    autocast_dtype: Any = None
    device_type: str = "cpu"
    check_overflow: bool = False

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def checks_overflow(self) -> bool:
        return self.loss_scaler is not None or self.check_overflow

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def update_scale(self, overflow: bool) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)

    def step_metrics(self) -> Dict[str, float]:
        return {"loss_scale": float(self.loss_scale)} if self.loss_scaler is not None else {}

    def skipped_step_message(self, step: int) -> str:
        if self.loss_scaler is None:
            return super().skipped_step_message(step)
        return f"overflow: step {step} skipped, loss scale lowered to {self.loss_scale:g}"

    def state_dict(self) -> Dict[str, Any]:
        return {"loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def dtype_from_name(name):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
