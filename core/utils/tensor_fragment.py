"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*``: a parameter's full fp32 value, gradient
and optimizer state, whatever part of it this rank's ZeRO stage holds.

Each function finds the ZeRO stage of the engine that trains ``param`` and asks it (the
``full_*`` methods of :class:`dsplug.contracts.ZeroStage`): at stage 0 everything is local; at
stages 1-3 the parts are gathered from every rank, so **every rank must call these functions
together, for the same parameters in the same order** (as in DeepSpeed).

* values are new fp32 tensors shaped like the parameter (a scalar optimizer state, such as a
  step count, is returned as the optimizer keeps it);
* ``safe_get_full_grad`` is meant for the time between the backward pass that ends an
  accumulation window and ``engine.step()``: the gradient is then reduced over ranks and summed
  over the window's micro-steps (each scaled by 1 / gradient_accumulation_steps), and still
  multiplied by the loss scale under fp16;
* they return None for a parameter no dsplug engine trains (not passed to ``initialize``, frozen,
  or left out of the optimizer), for a gradient the stage does not hold, and for an optimizer state
  the optimizer has not created yet.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..contracts.zero_stage import stage_of


def _stage(param):
    return stage_of(param)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 master value of ``param`` (its own value in fp32 training)."""
    stage = _stage(param)
    return None if stage is None else stage.full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master value and its training-dtype weight to ``value`` (the full value,
    equal on every rank). A parameter no engine trains is left alone."""
    stage = _stage(param)
    if stage is not None:
        _check_shape(param, value, "safe_set_full_fp32_param")
        stage.set_full_fp32_param(param, value)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The full fp32 gradient of ``param`` as the stage holds it for the coming step."""
    stage = _stage(param)
    return None if stage is None else stage.full_grad(param)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The optimizer's state ``optim_state_key`` of ``param`` (``"exp_avg"``, ``"exp_avg_sq"``, ...)."""
    stage = _stage(param)
    return None if stage is None else stage.full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite the optimizer's element-wise state ``optim_state_key`` of ``param`` with ``value``."""
    stage = _stage(param)
    if stage is not None:
        _check_shape(param, value, "safe_set_full_optimizer_state")
        stage.set_full_optimizer_state(param, optim_state_key, value)


def _check_shape(param, value, where: str) -> None:
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: the value has shape {tuple(value.shape)}, the parameter {shape}")


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state"]
