"""DeepSpeed's ``deepspeed.elasticity`` functions: ``compute_elastic_config``,
``elasticity_enabled``, ``ensure_immutable_elastic_config``.

``compute_elastic_config`` is meant to be called both by a resource scheduler (which GPU counts
may this job be given?) and by the runtime (which batch sizes does this world size get?); for one
config it always answers the same. The search itself is in :mod:`.search`.

Where dsplug differs from DeepSpeed's implementation (docs/elasticity.md, "Differences"):

* the batch size never exceeds ``max_train_batch_size`` (DeepSpeed's also tries the micro-batch
  sizes' lcm when it is larger than the maximum, and can return it);
* version 0.2 counts a node as valid when its GPUs fall in ``[min_gpus, max_gpus]`` (DeepSpeed
  rounds ``min_gpus / num_gpus_per_node`` down), and takes the micro-batch size from the
  data-parallel size (world size / model_parallel_size);
* ``return_microbatch=True`` without ``world_size`` reads ``WORLD_SIZE`` in both versions.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import List, Optional, Tuple

from . import constants as C
from .config import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize, ElasticitySection,
                     parse_elasticity, version_number)
from .search import BatchSearch, largest_dividing

logger = logging.getLogger("dsplug")


# ----------------------------------------------------------------------------- the solution
class ElasticBatch:
    """The solved section: ``final_batch_size`` and ``valid_gpus`` (data-parallel sizes; with
    model_parallel_size 1, GPU counts), and per world size the micro-batch size and accumulation."""

    def __init__(self, section: ElasticitySection, final_batch_size: int, valid_gpus: List[int]):
        self.section = section
        self.final_batch_size = final_batch_size
        self.valid_gpus = valid_gpus

    def micro_batch(self, dp_size: int) -> int:
        """The largest acceptable micro-batch size for ``dp_size`` data-parallel ranks."""
        per_rank, rest = divmod(self.final_batch_size, dp_size)
        micro = largest_dividing(self.section.micro_batch_sizes, per_rank) if not rest else None
        if micro is None:  # cannot happen for a size in valid_gpus; a guard, with the numbers
            raise ElasticityIncompatibleWorldSize(
                f"no micro-batch size in {list(self.section.micro_batch_sizes)} divides the batch "
                f"{self.final_batch_size} over {dp_size} data-parallel ranks")
        return micro

    def triple(self, dp_size: int) -> Tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        micro = self.micro_batch(dp_size)
        return self.final_batch_size, micro, self.final_batch_size // (micro * dp_size)


def _version(section: ElasticitySection) -> float:
    return version_number(section.version)


def solve_v01(section: ElasticitySection) -> ElasticBatch:
    """Version 0.1: one batch size for as many GPU counts in ``[min_gpus, max_gpus]`` as possible."""
    search = BatchSearch(section.micro_batch_sizes)
    batch, valid = search.best(section.max_train_batch_size, section.min_gpus, section.max_gpus,
                               section.prefer_larger_batch)
    if batch is None:
        smallest = min(section.micro_batch_sizes)
        raise ElasticityConfigError(
            f"no batch size <= max_train_batch_size={section.max_train_batch_size} runs on any GPU count in "
            f"[min_gpus={section.min_gpus}, max_gpus={section.max_gpus}] with micro_batch_sizes="
            f"{list(section.micro_batch_sizes)}: even min_gpus × the smallest micro-batch = "
            f"{section.min_gpus * smallest} must fit; raise max_train_batch_size or lower min_gpus")
    return ElasticBatch(section, batch, valid)


def _node_range(section: ElasticitySection) -> Tuple[int, int]:
    per_node = section.num_gpus_per_node
    low = max(1, -(-section.min_gpus // per_node))  # whole nodes with at least min_gpus GPUs
    high = section.max_gpus // per_node
    if high < low:
        raise ElasticityConfigError(
            f"no whole number of nodes of num_gpus_per_node={per_node} GPUs lies in [min_gpus={section.min_gpus}, "
            f"max_gpus={section.max_gpus}]")
    return low, high


def solve_v02(section: ElasticitySection, world_size: Optional[int]) -> ElasticBatch:
    """Version 0.2: the 0.1 search over whole nodes, each holding ``num_gpus_per_node /
    model_parallel_size`` data-parallel ranks. ``world_size`` (GPUs, model-parallel ranks
    included) outside the valid list gets a batch of its own, as DeepSpeed's 0.2 does:
    the largest (``prefer_larger_batch``; else smallest) ``k × m × dp <= max_train_batch_size``
    over the micro-batch sizes ``m``."""
    dp_per_node = section.num_gpus_per_node // section.model_parallel_size
    low, high = _node_range(section)
    search = BatchSearch(section.micro_batch_sizes)
    node_max = section.max_train_batch_size // dp_per_node
    batch, nodes = (None, []) if node_max < 1 else search.best(node_max, low, high, section.prefer_larger_batch)
    if batch is None:
        raise ElasticityConfigError(
            f"no batch size <= max_train_batch_size={section.max_train_batch_size} runs on any whole number of "
            f"nodes in [{low}, {high}] ({dp_per_node} data-parallel ranks per node) with micro_batch_sizes="
            f"{list(section.micro_batch_sizes)}")
    solution = ElasticBatch(section, batch * dp_per_node, [n * dp_per_node for n in nodes])
    if world_size is None:
        return solution
    dp = _data_parallel_size(section, world_size)
    if dp in solution.valid_gpus:
        return solution
    sizes = [(section.max_train_batch_size // (m * dp)) * m * dp for m in section.micro_batch_sizes]
    sizes = [s for s in sizes if s > 0]
    if not sizes:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} ({dp} data-parallel ranks) cannot run even one micro-batch of "
            f"{min(section.micro_batch_sizes)} per rank within max_train_batch_size={section.max_train_batch_size}")
    chosen = max(sizes) if section.prefer_larger_batch else min(sizes)
    logger.warning("[elasticity] %d data-parallel ranks is not in the elastic list %s: this run uses batch size %d "
                   "instead of %d", dp, solution.valid_gpus, chosen, solution.final_batch_size)
    return ElasticBatch(section, chosen, [dp])


def _data_parallel_size(section: ElasticitySection, world_size: int) -> int:
    if world_size % section.model_parallel_size:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not a multiple of elasticity.model_parallel_size="
            f"{section.model_parallel_size}")
    return world_size // section.model_parallel_size


def solve(section: ElasticitySection, world_size: Optional[int] = None) -> ElasticBatch:
    """The elastic batch of an enabled, parsed section. ``world_size``: GPUs (processes) of the
    current run, model-parallel ranks included; needed by version 0.2 when the run's size is not
    in its list (0.1 ignores it here: :func:`check_world_size` checks it)."""
    if _version(section) == 0.1:
        return solve_v01(section)
    return solve_v02(section, world_size)


def check_world_size(solution: ElasticBatch, world_size: int) -> int:
    """The data-parallel size of ``world_size`` GPUs, or :class:`ElasticityIncompatibleWorldSize`."""
    dp = _data_parallel_size(solution.section, world_size)
    if dp not in solution.valid_gpus:
        nearby = sorted(solution.valid_gpus, key=lambda g: (abs(g - dp), g))[:3]
        unit = "GPU counts" if solution.section.model_parallel_size == 1 else "data-parallel sizes"
        raise ElasticityIncompatibleWorldSize(
            f"World size ({world_size}) is not valid with the current list of valid {unit}: "
            f"{_show_list(solution.valid_gpus)} (final batch size {solution.final_batch_size}, micro_batch_sizes "
            f"{list(solution.section.micro_batch_sizes)}); the nearest valid: {sorted(nearby)}")
    return dp


def _show_list(values: List[int], limit: int = 40) -> str:
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} in all)]"


# ----------------------------------------------------------------------------- DeepSpeed's API
def _compatible_version(target_deepspeed_version) -> None:
    """``target_deepspeed_version``: the runtime a scheduler plans for. DeepSpeed has elasticity
    from 0.3.8; every dsplug version (its own ``__version__``) has it too."""
    from dsplug import __version__ as dsplug_version

    text = str(target_deepspeed_version).strip()
    if text == dsplug_version:
        return
    match = re.match(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)  # 0.14.0, 0.10.0rc1, 0.3.8+cu118
    if match is None:
        raise ElasticityError(f"target_deepspeed_version {target_deepspeed_version!r} is not a version number "
                              f"(e.g. '0.14.0', or dsplug's own '{dsplug_version}')")
    numbers = tuple(int(part or 0) for part in match.groups())
    minimum = tuple(int(p) for p in C.MINIMUM_DEEPSPEED_VERSION.split("."))
    if numbers < minimum:
        raise ElasticityError(f"Unable to run elasticity on target deepspeed version of {target_deepspeed_version}: "
                              f"elastic training needs DeepSpeed >= {C.MINIMUM_DEEPSPEED_VERSION} (or dsplug "
                              f"{dsplug_version})")


def _world_size_from_env(why: str) -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is None or not value.strip().isdigit() or int(value) < 1:
        raise ElasticityConfigError(f"{why} needs the world size: pass world_size to compute_elastic_config or set the "
                                    f"WORLD_SIZE environment variable (WORLD_SIZE is {value!r})")
    return int(value)


def enabled_section(ds_config) -> ElasticitySection:
    """The parsed ``elasticity`` section of ``ds_config``; ElasticityConfigError when it is
    missing, disabled or invalid."""
    if not isinstance(ds_config, Mapping):
        raise ElasticityConfigError(f"Expected ds_config to be a dictionary but received a "
                                    f"{type(ds_config).__name__}")
    if C.ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{C.ELASTICITY}' is missing from the config; add an \"elasticity\" section "
                                    "if running an elastic training job")
    section = parse_elasticity(ds_config[C.ELASTICITY])
    if not section.enabled:
        raise ElasticityConfigError("Elasticity is disabled; set \"elasticity\": {\"enabled\": true, ...} if running "
                                    "an elastic training job")
    return section


def compute_elastic_config(ds_config, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
    """The elastic batch size of ``ds_config`` and the GPU counts it runs on.

    ``ds_config``: the config dict (its ``elasticity`` section must be enabled).
    ``target_deepspeed_version``: the runtime version the job will run on (DeepSpeed >= 0.3.8, or
    dsplug's own version); an older one is an :class:`ElasticityError`.
    ``world_size``: the current number of GPUs (processes; model-parallel ranks included for
    version 0.2). When given it must be valid, and the micro-batch size is returned too: the
    largest of ``micro_batch_sizes`` dividing the batch per data-parallel rank.
    ``return_microbatch``: return the micro-batch size without ``world_size``: the world size is
    read from ``WORLD_SIZE`` (which version 0.2 always needs, to know its batch size).

    Returns ``(final_batch_size, valid_gpus)`` or, with a world size, ``(final_batch_size,
    valid_gpus, micro_batch_size)``. ``valid_gpus`` are GPU counts (data-parallel sizes when
    ``model_parallel_size > 1``), ascending. Errors: :class:`ElasticityConfigError` (section
    missing, disabled, invalid, or no batch size fits), :class:`ElasticityIncompatibleWorldSize`
    (``world_size`` not in ``valid_gpus``), :class:`ElasticityError` (target version).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ElasticityError(f"world_size must be a non-negative integer (0: not given), got {world_size!r}")
    section = enabled_section(ds_config)
    _compatible_version(target_deepspeed_version)
    version = _version(section)
    current = world_size
    if current == 0 and version == 0.2:
        current = _world_size_from_env("elasticity version 0.2")
    elif current == 0 and return_microbatch:
        current = _world_size_from_env("return_microbatch=True")
    solution = solve(section, current or None)
    logger.info("[elasticity] valid world sizes (GPUs / model-parallel size): %s", _show_list(solution.valid_gpus))
    if world_size == 0 and not return_microbatch:
        return solution.final_batch_size, solution.valid_gpus
    dp = check_world_size(solution, current)
    return solution.final_batch_size, solution.valid_gpus, solution.micro_batch(dp)


def elasticity_enabled(ds_config) -> bool:
    """Whether ``ds_config`` has an ``elasticity`` section with ``enabled: true``."""
    if not isinstance(ds_config, Mapping):
        return False
    section = ds_config.get(C.ELASTICITY)
    if not isinstance(section, Mapping):
        return False
    return section.get(C.ENABLED, C.ENABLED_DEFAULT) is True


#: the keys a resource scheduler and the runtime must agree on
IMMUTABLE_KEYS = (C.MAX_ACCEPTABLE_BATCH_SIZE, C.MICRO_BATCHES, C.VERSION)


def ensure_immutable_elastic_config(runtime_elastic_config_dict) -> None:
    """Check that the ``elasticity`` section the resource scheduler planned with (JSON in the
    environment variable ``DEEPSPEED_ELASTICITY_CONFIG``) agrees with the runtime's on
    ``max_train_batch_size``, ``micro_batch_sizes`` and ``version``; a difference is an
    :class:`ElasticityConfigError` naming the key. Without the variable nothing can be
    checked: a warning says so."""
    text = os.environ.get(C.DEEPSPEED_ELASTICITY_CONFIG)
    if text is None:
        logger.warning("Unable to find %s environment variable, cannot guarantee resource scheduler will scale this "
                       "job using compatible GPU counts.", C.DEEPSPEED_ELASTICITY_CONFIG)
        return
    try:
        scheduler_dict = json.loads(text)
    except ValueError as exc:
        raise ElasticityConfigError(f"{C.DEEPSPEED_ELASTICITY_CONFIG} is not JSON ({exc}); it must hold the "
                                    "scheduler's \"elasticity\" section") from None
    scheduler = parse_elasticity(scheduler_dict)
    runtime = parse_elasticity(runtime_elastic_config_dict)
    for key in IMMUTABLE_KEYS:
        theirs, ours = getattr(scheduler, key), getattr(runtime, key)
        if key == C.VERSION:
            theirs, ours = version_number(theirs), version_number(ours)
        if key == C.MICRO_BATCHES:
            theirs, ours = list(theirs), list(ours)
        if theirs != ours:
            raise ElasticityConfigError(
                f"Elastic config '{key}={theirs}' seen by resource scheduler does not match config passed to runtime "
                f"{key}={ours}")


__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config"]
