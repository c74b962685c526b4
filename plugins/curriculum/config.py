"""The legacy ``curriculum_learning`` section (DeepSpeed's config reference, "Curriculum Learning").

Everything but ``enabled`` is required once the section is enabled, as DeepSpeed's
``CurriculumScheduler`` asserts; which ``schedule_config`` keys are required depends on
``schedule_type``. Keys a schedule type does not use are accepted and ignored (as DeepSpeed does).
"""
from __future__ import annotations

from typing import List, Optional

from dsplug.config.schema import field, schema

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")
#: schedule_type -> the schedule_config keys it needs
NEEDS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}


@schema
class LegacyCurriculumScheduleConfig:
    total_curriculum_step: Optional[int] = field(
        None, ge=1, doc="steps to go from min_difficulty to max_difficulty (fixed_linear, fixed_root)")
    difficulty_step: Optional[int] = field(
        None, ge=1, doc="the difficulty is rounded down to a multiple of this (fixed_linear, fixed_root); "
                        "8 (fp16) or 16 (int8) for Tensor Cores")
    root_degree: Optional[float] = field(
        None, gt=0, doc="degree of the root: 2 = square root, 1 = linear (fixed_root)")
    difficulty: Optional[List[int]] = field(
        None, ge=1, doc="difficulty levels, one more than max_step (fixed_discrete)")
    max_step: Optional[List[int]] = field(
        None, ge=0, doc="last step of each level but the last; increasing (fixed_discrete)")


def _needs(values):
    if not values["enabled"]:
        return None
    problems = [(key, "required when curriculum_learning.enabled is true")
                for key in ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type")
                if values[key] is None]
    if values["min_difficulty"] is not None and values["max_difficulty"] is not None \
            and values["min_difficulty"] > values["max_difficulty"]:
        problems.append(("min_difficulty", f"{values['min_difficulty']} is above max_difficulty "
                                           f"{values['max_difficulty']}"))
    kind = values["schedule_type"]
    if kind is None:
        return problems
    cfg = values["schedule_config"]
    problems += [(f"schedule_config.{key}", f"required by schedule_type {kind!r}") for key in NEEDS[kind]
                 if cfg[key] is None]
    if kind == "fixed_discrete" and cfg["difficulty"] is not None and cfg["max_step"] is not None:
        difficulty, max_step = cfg["difficulty"], cfg["max_step"]
        if not max_step:
            problems.append(("schedule_config.max_step", "must list at least one step"))
        elif len(difficulty) != len(max_step) + 1:
            problems.append(("schedule_config.difficulty",
                             f"has {len(difficulty)} levels; fixed_discrete needs one more than max_step's "
                             f"{len(max_step)} (the last level holds after the last max_step)"))
        if any(b <= a for a, b in zip(max_step, max_step[1:])):
            problems.append(("schedule_config.max_step", f"{max_step} must be increasing"))
    return problems


@schema
class LegacyCurriculumConfig:
    enabled: bool = field(False, doc="change the difficulty (sequence length) with the global step")
    curriculum_type: Optional[str] = field(
        None, choices=("seqlen",), doc="'seqlen': the model's forward gets curriculum_seqlen=<difficulty>")
    min_difficulty: Optional[int] = field(None, ge=1, doc="difficulty at the start")
    max_difficulty: Optional[int] = field(None, ge=1, doc="final difficulty")
    schedule_type: Optional[str] = field(None, choices=SCHEDULE_TYPES, doc="the pacing function")
    schedule_config: LegacyCurriculumScheduleConfig = field(factory=LegacyCurriculumScheduleConfig,
                                                      doc="the pacing function's parameters")

    __rules__ = (_needs,)
