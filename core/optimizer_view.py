"""``engine.optimizer`` where DeepSpeed would hand back a wrapper optimizer.

Under ZeRO stages 1-3, or fp16 / bf16 training, DeepSpeed wraps the client optimizer in a ZeRO or
mixed-precision optimizer, returns that wrapper from ``initialize()`` and as ``engine.optimizer``,
and keeps the optimizer it wraps as the wrapper's ``.optimizer``. Scripts, Hugging Face Accelerate
and DeepSpeed's own tests rely on that shape: ``engine.optimizer.optimizer`` is the base optimizer
(``FusedAdam``, ``DeepSpeedCPUAdam`` under offload, ``torch.optim.AdamW`` with ``torch_adam`` ...),
and ``engine.optimizer.overflow`` says whether the last step was skipped.

dsplug does the wrapping in the engine's precision and ZeRO-stage plugins, so there is no wrapper to
hand back. :class:`WrappedOptimizer` gives the same shape over the optimizer the stage trains
(``engine.basic_optimizer``): ``.optimizer`` is it; ``param_groups``, ``state``, ``state_dict()``,
and every other attribute are its; ``step()`` / ``zero_grad()`` are the ZeRO stage's (the whole
update: reduction's result unscaled, clipped, stepped, weights refreshed; or dropping the
gradients the stage holds), as DeepSpeed's wrappers' are, without the engine's bookkeeping (LR
scheduler, step counters: that is ``engine.step()``); ``overflow``, ``_global_grad_norm`` and
``loss_scale`` / ``cur_scale`` are the stage's and the precision's. A name the base optimizer lacks is looked up on the ZeRO stage's
``wrapper_internals`` (optional, see :class:`dsplug.contracts.ZeroStage`): the wrapper internals a
stage can answer, such as stage 3's ``get_fp32_grad_partitions()``. It is a ``torch.optim.Optimizer``
(DeepSpeed's wrappers are not), so code that type-checks, torch's LR schedulers included, takes it;
everything it holds is the base optimizer's, so a schedule built on it drives what trains (an LR
scheduler callable passed to ``initialize()`` gets the base optimizer itself, as in DeepSpeed).
"""
from __future__ import annotations

from typing import Any

import torch

#: attributes kept on the view itself; every other one is the base optimizer's
_OWN = frozenset({"optimizer", "overflow", "_precision", "_stage"})


def wraps_optimizer(zero_stage: int, precision_name: str) -> bool:
    """Whether DeepSpeed hands back a wrapper here: ZeRO stages 1-3, or fp16 / bf16 (not torch amp)."""
    return zero_stage > 0 or precision_name in ("fp16", "bf16")


class WrappedOptimizer(torch.optim.Optimizer):
    """DeepSpeed's wrapper-optimizer surface over ``optimizer``, the optimizer ``stage`` (the
    engine's ZeRO stage) trains; ``precision`` answers the loss scale. ``torch.optim.Optimizer.__init__``
    is not called: the instance holds no groups, state or hooks of its own, and torch's methods it
    inherits (``add_param_group``, the hook registrations) reach the base optimizer's through
    :meth:`__getattr__` and the properties below."""

    def __init__(self, optimizer, precision, stage) -> None:  # noqa: super().__init__ not called
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "overflow", False)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        for owner in (self.optimizer, getattr(self._stage, "wrapper_internals", None)):
            if owner is not None:
                try:
                    return getattr(owner, name)
                except AttributeError:
                    pass
        raise AttributeError(f"engine.optimizer ({type(self).__name__} over {type(self.optimizer).__name__}) "
                             f"has no attribute {name!r}: neither the optimizer nor the ZeRO stage's "
                             "wrapper_internals has it")

    def __setattr__(self, name: str, value: Any) -> None:
        """The view's own names and the names its class defines (a method replaced on the view, as
        torch's LR scheduler replaces ``step``; a property's setter) stay on the view; any other
        attribute is set on the base optimizer."""
        if name in _OWN or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.optimizer, name, value)

    # Spelled out (not only through __getattr__) so that they show in dir() and help().
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def _global_grad_norm(self):
        """The global gradient norm of the last step (before clipping), DeepSpeed's attribute."""
        return self._stage.last_grad_norm

    def __getstate__(self):
        return {"optimizer": self.optimizer, "_precision": self._precision, "_stage": self._stage,
                "overflow": self.overflow}

    def __setstate__(self, state) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def loss_scale(self) -> float:
        return self._precision.loss_scale

    @property
    def cur_scale(self) -> float:
        return self._precision.loss_scale

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients the stage holds (its partitions too), as DeepSpeed's wrappers do."""
        self._stage.zero_grad()

    def step(self, closure=None):
        """The stage's update (False from the stage, an overflow, skips it: ``overflow`` says so)."""
        loss = closure() if closure is not None else None
        self.overflow = not self._stage.step()
        return loss

    def __repr__(self) -> str:
        return f"WrappedOptimizer({self.optimizer!r})"
