"""Splitting a sequence of layers into contiguous pipeline stages.

A partition is DeepSpeed's ``parts`` list: ``num_stages + 1`` boundaries, stage ``s`` owning the
layers ``parts[s] <= i < parts[s + 1]``.

* :func:`partition_uniform` balances layer counts: every stage gets ``n // S`` layers and the
  first ``n % S`` stages one more.
* :func:`partition_balanced` balances weights (parameter counts, or 0/1 marks of the layers whose
  class matches a pattern): it finds the smallest possible bottleneck ``B*`` (the largest stage
  weight, minimised over all contiguous partitions) and then fills the stages front to back, each
  taking as many layers as fit under ``B*`` while leaving at least one layer for every later
  stage. So each stage is non-empty (when there are at least as many layers as stages), no stage
  weighs more than ``B*``, and ties go to the earlier stages (layers of weight 0 after a stage's
  last weighted layer stay with it).
"""
from __future__ import annotations

from typing import List, Sequence


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first ``num_items % num_parts``
    parts one more (with fewer items than parts, the first ``num_items`` parts get one each)."""
    _check(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def _parts_needed(weights: Sequence[int], bottleneck) -> int:
    """Stages the front-to-back greedy fill needs when no stage may exceed ``bottleneck``."""
    parts, load = 1, 0
    for w in weights:
        if load + w > bottleneck:
            parts += 1
            load = 0
        load += w
    return parts


def min_bottleneck(weights: Sequence[int], num_parts: int):
    """The smallest achievable largest-part weight over all splits into ``num_parts`` contiguous parts
    (binary search over integer bottlenecks; weights must be non-negative integers)."""
    if not weights:
        return 0
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(weights, mid) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def partition_balanced(weights: Sequence[int], num_parts: int) -> List[int]:
    """Boundaries minimising the heaviest part (see the module docstring for the tie rule)."""
    weights = [int(w) for w in weights]
    if any(w < 0 for w in weights):
        raise ValueError(f"partition weights must be non-negative, got {weights}")
    n = len(weights)
    _check(n, num_parts)
    bottleneck = min_bottleneck(weights, num_parts)
    parts, start = [0], 0
    for s in range(num_parts):
        later = num_parts - s - 1
        end, load = start, 0
        # take layers while they fit under the bottleneck, leaving one for every later stage
        while end < n and n - (end + 1) >= min(later, n - start - 1) and load + weights[end] <= bottleneck:
            load += weights[end]
            end += 1
        if end == start and start < n and n - start > later:  # a stage takes at least one layer
            end = start + 1
        if s == num_parts - 1:
            end = n
        parts.append(end)
        start = end
    return parts


def _check(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {num_parts}")
    if num_items < 0:
        raise ValueError(f"the number of layers must be non-negative, got {num_items}")
