"""Pacing functions: the curriculum difficulty per step and random-LTD's kept tokens per step.

DeepSpeed's formulas (``CurriculumScheduler`` / ``RandomLTDScheduler``), with ``s`` the step:

* ``fixed_linear``: ``fixed_root`` with ``root_degree = 1``;
* ``fixed_root``: ``d = floor(min(1, s / total_curriculum_step) ** (1 / root_degree) * (max - min)
  + min)``, then ``d -= d % difficulty_step`` and ``d = min(d, max)``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, and
  ``difficulty[-1]`` after the last ``max_step``;
* ``custom``: ``fn(s)`` given through ``engine.set_custom_curriculum_learning_schedule``.

Once the difficulty reaches ``max_difficulty`` it is not recomputed (DeepSpeed's
``update_difficulty``). Random-LTD's ``fixed_linear``: ``v = floor(min(1, s / require_steps) *
(max_value - min_value) + min_value)``, ``v -= v % seq_per_step``, ``v = min(v, max_value)``.

One deviation: DeepSpeed does not clamp ``s / total`` to 1, which matters only past the
schedule's end when ``max`` is not a multiple of the rounding step (DeepSpeed's value then jumps
from the rounded-down value to ``max`` some steps later; here it stays).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence


def fixed_root(step: int, total_step: int, min_value: int, max_value: int, rounding_step: int,
               root_degree: float = 1) -> int:
    fraction = min(1.0, float(step) / total_step) ** (1.0 / root_degree)
    value = math.floor(fraction * (max_value - min_value) + min_value)
    value -= value % rounding_step
    return min(value, max_value)


def fixed_discrete(step: int, difficulty: Sequence[int], max_step: Sequence[int]) -> int:
    for level, last in zip(difficulty, max_step):
        if step <= last:
            return level
    return difficulty[-1]


class CurriculumSchedule:
    """One metric's difficulty schedule (a parsed ``curriculum_metrics.<name>`` entry)."""

    def __init__(self, metric_config, name: str = "metric"):
        self.name = name
        self.config = metric_config
        self.type = metric_config.schedule_type
        self.min_difficulty = metric_config.min_difficulty
        self.max_difficulty = metric_config.max_difficulty
        self.current_difficulty = metric_config.min_difficulty
        self.custom_fn: Optional[Callable[[int], int]] = None

    def set_custom_get_difficulty(self, fn: Callable[[int], int]) -> None:
        self.custom_fn = fn

    def get_difficulty(self, step: int) -> int:
        cfg = self.config.schedule_config
        if self.type == "fixed_linear":
            return fixed_root(step, cfg.total_curriculum_step, self.min_difficulty, self.max_difficulty,
                              cfg.difficulty_step, 1)
        if self.type == "fixed_root":
            return fixed_root(step, cfg.total_curriculum_step, self.min_difficulty, self.max_difficulty,
                              cfg.difficulty_step, cfg.root_degree)
        if self.type == "fixed_discrete":
            return fixed_discrete(step, cfg.difficulty, cfg.max_step)
        if self.custom_fn is None:
            raise RuntimeError(f"curriculum metric {self.name!r} has schedule_type 'custom' but no schedule was given: "
                               "call engine.set_custom_curriculum_learning_schedule({name: fn}) (fn(step) -> "
                               "difficulty) before training")
        return self.custom_fn(step)

    def update_difficulty(self, step: int):
        if self.current_difficulty < self.max_difficulty:
            self.current_difficulty = self.get_difficulty(step)
        return self.current_difficulty


def random_ltd_value(step: int, min_value: int, max_value: int, require_steps: int, seq_per_step: int) -> int:
    """Kept tokens per sample at ``step`` (random-LTD's ``fixed_linear``)."""
    return fixed_root(step, require_steps, min_value, max_value, seq_per_step, 1)
