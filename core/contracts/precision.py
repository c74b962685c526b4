"""The precision contract: dtypes, loss scaling, autocast and overflow handling."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List

from ..hookspecs import hookimpl


class Precision:
    """What a precision factory returns. Subclass it and set the attributes.

    The engine and the ZeRO stage follow it:

    * ``model_dtype``: the module's parameters are cast to it at initialize.
    * ``master_weights``: the stage keeps fp32 master copies that the optimizer updates and
      copies back into the (16-bit) parameters after each step.
    * ``grad_accum_dtype``: gradients accumulate in it between micro-steps (None: model dtype).
    * ``checks_overflow``: the stage skips a step whose gradient norm is not finite, and tells
      :meth:`update_scale`.
    * :meth:`autocast` wraps every forward; :meth:`scale_loss` every backward;
      :meth:`unscale_` the reduced gradients before clipping.
    * :meth:`step_metrics` adds to each step's metrics (``loss_scale``) for monitors.

    Checkpoint: :meth:`state_dict` is saved in every rank's file under ``"precision"`` and handed
    back to :meth:`load_state_dict` (not with ``load_module_only``).
    """

    name: str = "abstract"
    model_dtype: Any = None
    master_weights: bool = False
    grad_accum_dtype: Any = None
    checks_overflow: bool = False

    @property
    def loss_scale(self) -> float:
        """The factor losses are multiplied by before backward (1.0: no scaling)."""
        return 1.0

    def autocast(self):
        """A context manager entered around each forward (default: none)."""
        return contextlib.nullcontext()

    def scale_loss(self, loss):
        """The tensor to call ``backward()`` on for ``loss``."""
        scale = self.loss_scale
        return loss if scale == 1.0 else loss.float() * scale

    def unscale_(self, grads: List[Any]) -> None:
        """Divide the reduced gradients by the loss scale, in place."""
        scale = self.loss_scale
        if scale != 1.0:
            import torch

            torch._foreach_mul_(grads, 1.0 / scale)

    def update_scale(self, overflow: bool) -> None:
        """Called once per optimizer step with whether the gradients overflowed."""

    def step_metrics(self) -> Dict[str, float]:
        """Extra metrics for this step (e.g. ``{"loss_scale": 1024.0}``)."""
        return {}

    def skipped_step_message(self, step: int) -> str:
        """The line logged when step ``step`` is skipped because of an overflow."""
        return f"non-finite gradients: step {step} skipped"

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    # -- checkpoint participation (see dsplug.hookspecs)
    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {"precision": self.state_dict()} if scope == "rank" else None

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        state = checkpoint.rank.get("precision")
        if state is not None and not checkpoint.options.load_module_only:
            self.load_state_dict(state)
