"""Progressive layer dropping (PLD): the schedule, the engine observer applying it, its engine methods.

The keep probability of the schedule (Zhang & He 2020, DeepSpeed's ``ProgressiveLayerDrop``)::

    theta(t) = (1 - theta) * exp(-gamma * t) + theta

It starts at 1.0. As in DeepSpeed's engine, at every optimizer-step boundary the state is
updated with ``t`` = the global step *before* that step is counted (DeepSpeed calls
``update_state(global_steps)`` before ``_take_model_step`` increments it; here the observer
does the same after the step, with ``engine.global_steps - 1``, which is the same value), so the
forwards of global step ``g`` (``engine.global_steps == g``, counted from 0) use ``1.0`` when
``g == 0`` and ``theta(g - 1)`` after that. While the module is in training mode each forward
gets ``progressive_layer_drop=True, pld_theta=<current theta(t)>`` (keywords the caller passes
itself win); in eval mode nothing is passed. Which layers to skip is the model's business
(the paper: layer ``i`` of ``L`` is kept with probability ``1 - i / L * (1 - theta(t))``).

The current theta is saved in the shared checkpoint file under ``"progressive_layer_drop"``.
Engine methods (DeepSpeed's): ``pld_enabled()``, ``pld_params()`` (the section without
``enabled``, or False when the config has none), ``pld_theta()``, ``pld_gamma()`` (the
configured values) and ``get_pld_theta()`` (the current theta(t), None when PLD is off).
"""
from __future__ import annotations

import math

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

SECTION = "progressive_layer_drop"
STATE_KEY = "progressive_layer_drop"


def keep_probability(step: float, theta: float, gamma: float) -> float:
    """``theta(t) = (1 - theta) * exp(-gamma * t) + theta``."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


class ProgressiveLayerDrop(Observer):
    """One engine's PLD schedule (DeepSpeed's ``ProgressiveLayerDrop`` interface: ``get_theta``,
    ``get_state``, ``update_state(global_step)``)."""

    name = SECTION

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_state(self):
        """The keywords the model's forward gets."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = keep_probability(global_step, self.theta, self.gamma)

    @hookimpl
    def dsplug_forward_begin(self, engine):
        return self.get_state() if engine.module.training else None

    @hookimpl
    def dsplug_step_end(self, engine):
        self.update_state(engine.global_steps - 1)

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {STATE_KEY: {"current_theta": self.current_theta}} if scope == "model" else None

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        state = checkpoint.model.get(STATE_KEY)
        if state is not None and not checkpoint.options.load_module_only:
            self.current_theta = float(state["current_theta"])


def build_observer(section, context):
    """``factory(section, context)``: the schedule, or None when the section is disabled."""
    if section is None or not section.enabled:
        return None
    return ProgressiveLayerDrop(theta=section.theta, gamma=section.gamma)


def engine_methods(engine):
    """DeepSpeed's engine accessors of PLD (present on every engine)."""
    observer = next((o for o in engine.observers if isinstance(o, ProgressiveLayerDrop)), None)
    section = engine.config.section(SECTION)

    def pld_params():
        return {"theta": section.theta, "gamma": section.gamma} if SECTION in engine.config.sections else False

    return {
        "pld_enabled": lambda: observer is not None,
        "pld_params": pld_params,
        "pld_theta": lambda: section.theta,
        "pld_gamma": lambda: section.gamma,
        "get_pld_theta": lambda: observer.get_theta() if observer is not None else None,
    }


def deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes: ``pld_enabled`` (the section's ``enabled``) and
    ``pld_params`` (the section without ``enabled``, or False when the config has none)."""
    section = config.sections.get(SECTION)
    if section is None:
        return {"pld_enabled": False, "pld_params": False}
    return {"pld_enabled": section.enabled is True, "pld_params": {"theta": section.theta, "gamma": section.gamma}}
