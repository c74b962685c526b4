"""Registers legacy curriculum learning: it owns the top-level ``curriculum_learning`` section.

With ``curriculum_learning.enabled`` the engine gets a :class:`CurriculumObserver`, which does
what DeepSpeed's engine does in ``forward``: while the module is in training mode, each forward
(every micro-step) first calls ``update_difficulty(engine.global_steps + 1)`` -- the step being
computed, counted from 1, so the first optimizer step uses the schedule at step 1 -- and, with
``curriculum_type: "seqlen"``, passes ``curriculum_seqlen=<current difficulty>`` to the model's
forward (a keyword the caller passes itself wins). In eval mode nothing is updated or passed.

The scheduler's state is saved in the shared checkpoint file under ``"curriculum_learning"``;
loading takes back the current difficulty, so a resumed run continues the schedule exactly
(the difficulty never goes back down once it reached ``max_difficulty``).

Engine methods (DeepSpeed's): ``curriculum_enabled_legacy()``, ``curriculum_params_legacy()``
(the section without ``enabled``, or False when the config has none) and, when enabled, the
attribute ``curriculum_scheduler_legacy`` (the :class:`~.scheduler.CurriculumScheduler`).
"""
from __future__ import annotations

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

SECTION = "curriculum_learning"
STATE_KEY = "curriculum_learning"


class CurriculumObserver(Observer):
    """One engine's legacy curriculum schedule."""

    name = SECTION

    def __init__(self, config):
        from .scheduler import CurriculumScheduler

        self.config = config
        self.scheduler = CurriculumScheduler(config)

    @hookimpl
    def dsplug_forward_begin(self, engine):
        if not engine.module.training:
            return None
        difficulty = self.scheduler.update_difficulty(engine.global_steps + 1)
        if self.config.curriculum_type == "seqlen":
            return {"curriculum_seqlen": difficulty}
        return None

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        if scope != "model":
            return None
        return {STATE_KEY: {"current_difficulty": self.scheduler.get_current_difficulty(),
                            "first_step": self.scheduler.first_step}}

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        state = checkpoint.model.get(STATE_KEY)
        if state is None or checkpoint.options.load_module_only:
            return
        self.scheduler.set_current_difficulty(state["current_difficulty"])
        self.scheduler.first_step = bool(state.get("first_step", False))


def build_observer(section, context):
    """``factory(section, context)``: the observer, or None when the section is disabled."""
    if section is None or not section.enabled:
        return None
    return CurriculumObserver(section)


def _params(engine):
    return _section_params(engine.config)


def _section_params(config):
    """The section without ``enabled`` (and without unset keys), or False when the config has none."""
    from dsplug.config.schema import to_dict

    if SECTION not in config.sections:
        return False
    params = {k: v for k, v in to_dict(config.sections[SECTION]).items() if k != "enabled" and v is not None}
    if isinstance(params.get("schedule_config"), dict):
        params["schedule_config"] = {k: v for k, v in params["schedule_config"].items() if v is not None}
    return params


def engine_methods(engine):
    """DeepSpeed's engine accessors of the legacy curriculum (present on every engine)."""
    observer = next((o for o in engine.observers if isinstance(o, CurriculumObserver)), None)
    methods = {
        "curriculum_enabled_legacy": lambda: observer is not None,
        "curriculum_params_legacy": lambda: _params(engine),
    }
    if observer is not None:  # DeepSpeed's engine has this attribute only when the curriculum is on
        methods["curriculum_scheduler_legacy"] = observer.scheduler
    return methods


def deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes: ``curriculum_enabled_legacy`` (the section's
    ``enabled``) and ``curriculum_params_legacy`` (the section without ``enabled``, or False)."""
    section = config.sections.get(SECTION)
    return {"curriculum_enabled_legacy": getattr(section, "enabled", False) is True,
            "curriculum_params_legacy": _section_params(config)}
