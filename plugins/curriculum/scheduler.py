"""DeepSpeed's legacy ``CurriculumScheduler``: the difficulty (a sequence length) per global step.

For a step ``s`` (the engine passes ``global_steps + 1``: the step being computed, counted from 1):

* ``fixed_linear`` and ``fixed_root`` (``root_degree`` ``k``; linear is ``k = 1``)::

      d = floor((s / total_curriculum_step) ** (1 / k) * (max_difficulty - min_difficulty) + min_difficulty)
      d = d - d % difficulty_step        # rounded down to a multiple of difficulty_step
      d = min(d, max_difficulty)

  The ratio is not clamped before rounding (DeepSpeed's arithmetic, kept exactly): when
  ``max_difficulty`` is not a multiple of ``difficulty_step`` the difficulty reaches it only
  once the unclamped value rounds down to ``max_difficulty`` or above, i.e. somewhat after
  ``total_curriculum_step``. Nor is the result raised to ``min_difficulty``: a ``min_difficulty``
  that is not a multiple of ``difficulty_step`` starts below it.
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, and
  ``difficulty[-1]`` after the last ``max_step`` (``len(difficulty) == len(max_step) + 1``).

:meth:`CurriculumScheduler.update_difficulty` moves the current difficulty only while it is
below ``max_difficulty``: once reached, it stays there.
"""
from __future__ import annotations

import math
from typing import Any, Dict

MIN, MAX, CURRENT, TYPE, SCHEDULE = "min_difficulty", "max_difficulty", "current_difficulty", "schedule_type", \
    "schedule_config"


def root_difficulty(step: int, min_difficulty: int, max_difficulty: int, total_curriculum_step: int,
                    difficulty_step: int, root_degree: float = 1) -> int:
    """``fixed_linear`` (``root_degree=1``) and ``fixed_root``: see the module docstring."""
    ratio = (float(step) / total_curriculum_step) ** (1.0 / root_degree)
    difficulty = math.floor(ratio * (max_difficulty - min_difficulty) + min_difficulty)
    difficulty -= difficulty % difficulty_step
    return min(difficulty, max_difficulty)


def discrete_difficulty(step: int, difficulty, max_step) -> int:
    """``fixed_discrete``: ``difficulty[i]`` for the first ``step <= max_step[i]``, else the last."""
    for level, last in zip(difficulty, max_step):
        if step <= last:
            return level
    return difficulty[-1]


class CurriculumScheduler:
    """The difficulty schedule with DeepSpeed's interface (``get_current_difficulty``,
    ``update_difficulty(global_steps)``, ``get_difficulty``, ``get_state`` / ``set_state``).

    ``config``: the parsed ``curriculum_learning`` section (or a dict with its keys).
    """

    def __init__(self, config):
        if not isinstance(config, dict):
            from dsplug.config.schema import to_dict

            config = to_dict(config)
        schedule = {k: v for k, v in (config.get(SCHEDULE) or {}).items() if v is not None}
        self.state: Dict[str, Any] = {MIN: config[MIN], MAX: config[MAX], CURRENT: config[MIN],
                                      TYPE: config[TYPE], SCHEDULE: schedule}
        self.first_step = True  # DeepSpeed's flag for its pipeline engine (activation shapes)

    def get_current_difficulty(self) -> int:
        return self.state[CURRENT]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state[CURRENT] = difficulty

    def get_state(self) -> Dict[str, Any]:
        return self.state

    def set_state(self, state: Dict[str, Any]) -> None:
        self.state = state

    def get_difficulty(self, global_steps: int) -> int:
        s = self.state[SCHEDULE]
        kind = self.state[TYPE]
        if kind == "fixed_discrete":
            return discrete_difficulty(global_steps, s["difficulty"], s["max_step"])
        if kind in ("fixed_linear", "fixed_root"):
            degree = 1 if kind == "fixed_linear" else s["root_degree"]
            return root_difficulty(global_steps, self.state[MIN], self.state[MAX], s["total_curriculum_step"],
                                   s["difficulty_step"], degree)
        raise ValueError(f"unsupported curriculum schedule_type {kind!r}")

    def update_difficulty(self, global_steps: int) -> int:
        if self.state[CURRENT] < self.state[MAX]:
            self.state[CURRENT] = self.get_difficulty(global_steps)
        return self.state[CURRENT]
