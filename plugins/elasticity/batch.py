"""The elastic batch triple: the elasticity plugin's answer to the kernel's ``dsplug_batch_sizes``.

At ``world_size`` data-parallel ranks, ``train_batch_size`` is the elastic batch,
``train_micro_batch_size_per_gpu`` the largest acceptable micro-batch that divides it per rank, and
``gradient_accumulation_steps`` the rest. Batch keys given outside the section must agree with
those values (``"auto"`` always does), or ``ignore_non_elastic_batch_info`` must be true, in which
case they are replaced, with a warning. Cheap to import (no torch).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from . import constants as C

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def elastic_batch_sizes(config, world_size, report) -> Optional[Dict[str, Any]]:
    """The elastic batch triple at ``world_size`` (None when elasticity is not enabled)."""
    from .config import ElasticityError, missing_required, version_number
    from .elasticity import check_world_size, solve

    section = config.sections.get(C.ELASTICITY)
    if section is None:  # absent, or invalid (its schema reported why): enabled means the batch is ours
        raw = config.raw.get(C.ELASTICITY)
        return {} if isinstance(raw, dict) and raw.get("enabled") is True else None
    if not section.enabled:
        return None
    missing = missing_required(config.raw.get(C.ELASTICITY))
    for key in missing:
        report.error(f"{C.ELASTICITY}.{key}", "required when elasticity is enabled (the elastic batch sizes are "
                     "computed from max_train_batch_size and micro_batch_sizes)")
    if missing or any(issue.path.startswith(C.ELASTICITY) for issue in report.errors):
        return {}  # the section itself is invalid (reported here or by its schema)
    given = _given(config)
    mp = section.model_parallel_size
    try:
        if world_size is not None:
            solution = solve(section, world_size * mp)
            check_world_size(solution, world_size * mp)
            decided = dict(zip((TB, MB, GAS), solution.triple(world_size)))
        elif version_number(section.version) == 0.2:
            decided = {}  # 0.2's batch can depend on the world size: nothing to say without one
        else:
            solution = solve(section)
            decided = {TB: solution.final_batch_size}
            if all(v is not None for v in given.values()) and given[TB] % (given[MB] * given[GAS]) == 0:
                implied = given[TB] // (given[MB] * given[GAS])  # a fully given triple names its world size
                if implied in solution.valid_gpus:
                    decided = dict(zip((TB, MB, GAS), solution.triple(implied)))
    except ElasticityError as exc:
        report.error(C.ELASTICITY, str(exc))
        return {}
    _check_given(section, given, decided, world_size, report)
    _check_scheduler_agrees(config, report)
    return decided


def _check_given(section, given, decided, world_size, report) -> None:
    """Batch keys outside the section that disagree with the elastic values: an error, or with
    ``ignore_non_elastic_batch_info`` a warning (the elastic values win)."""
    at = f" at world size {world_size}" if world_size is not None else ""
    for key, value in given.items():
        if value is None or key not in decided or decided[key] == value:
            continue
        if section.ignore_non_elastic_batch_info:
            report.notice(key, f"{value} is replaced by the elastic value {decided[key]}{at} "
                               "(elasticity.ignore_non_elastic_batch_info is true)")
        else:
            elastic = ", ".join(f"{k}={decided[k]}" for k in (TB, MB, GAS) if k in decided)
            report.error(key, f"{value} disagrees with the elastic batch sizes{at} ({elastic}): elastic training "
                              f"sets the batch sizes. Remove {key} (micro-batch and accumulation change with the "
                              "world size), or set elasticity.ignore_non_elastic_batch_info to true")


def _check_scheduler_agrees(config, report) -> None:
    """When a resource scheduler says which section it planned with, it must be this one."""
    if os.environ.get(C.DEEPSPEED_ELASTICITY_CONFIG) is None:
        return
    from .config import ElasticityError
    from .elasticity import ensure_immutable_elastic_config

    try:
        ensure_immutable_elastic_config(config.raw.get(C.ELASTICITY, {}))
    except ElasticityError as exc:
        report.error(C.ELASTICITY, str(exc))


def _given(config) -> Dict[str, Optional[int]]:
    """The batch keys the config gives with a value (``"auto"`` and absent keys are None)."""
    out = {}
    for key in (TB, MB, GAS):
        value = getattr(config.kernel, key)
        out[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return out
