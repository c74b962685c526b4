"""The integer search behind elastic batch sizes (pure functions, no torch).

A global batch ``B`` runs on ``g`` GPUs when some acceptable micro-batch size ``m`` and a whole
number of accumulation steps ``gas`` give ``B = m × gas × g``, i.e. when ``m × g`` divides
``B``. Elastic training wants one ``B`` (<= ``max_train_batch_size``) that runs on as many GPU
counts in ``[min_gpus, max_gpus]`` as possible, so that the job can shrink or grow without
changing the batch the optimizer sees.

Version 0.1 (DeepSpeed's documented "highly composite batch size"): for each base ``b`` (every
micro-batch size and, when it fits, their least common multiple) the candidate is
``b × h`` with ``h`` the largest highly composite number (a number with more divisors than
every smaller one) such that ``b × h <= max_train_batch_size``; many divisors of ``h`` mean
many GPU counts. The candidate valid for the most GPU counts wins; a tie goes to the larger
batch (``prefer_larger_batch``) or the smaller one.

Version 0.2 scales by whole nodes of ``num_gpus_per_node`` GPUs, each holding
``num_gpus_per_node / model_parallel_size`` data-parallel ranks: the 0.1 search runs over node
counts with the batch limit per node's data-parallel share, and the result is scaled back up.
"""
from __future__ import annotations

import math
from functools import lru_cache, reduce
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

#: enough primes for any highly composite number the search needs: their product is ~5.6e26, far
#: beyond max_train_batch_size's bound of 2**40
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71)


@lru_cache(maxsize=64)
def highly_composite_numbers(limit: int) -> Tuple[int, ...]:
    """Every highly composite number ``<= limit``, ascending (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, ...).

    A highly composite number has the form ``2^a · 3^b · 5^c · ...`` over consecutive primes
    with non-increasing exponents (rearranging the exponents that way never raises the value nor
    changes the divisor count), so it is enough to walk those numbers and keep each one whose
    divisor count beats every smaller one's.
    """
    if limit < 1:
        return ()
    found: List[Tuple[int, int]] = []  # (value, divisor count)

    def walk(index: int, value: int, max_exponent: int, divisors: int) -> None:
        found.append((value, divisors))
        if index >= len(_SMALL_PRIMES):
            return
        prime = _SMALL_PRIMES[index]
        power = value
        for exponent in range(1, max_exponent + 1):
            power *= prime
            if power > limit:
                break
            walk(index + 1, power, exponent, divisors * (exponent + 1))

    walk(0, 1, limit.bit_length(), 1)
    found.sort()
    out, best = [], 0
    for value, divisors in found:
        if divisors > best:
            out.append(value)
            best = divisors
    return tuple(out)


def largest_highly_composite(limit: int) -> int:
    """The largest highly composite number ``<= limit`` (``limit >= 1``)."""
    return highly_composite_numbers(limit)[-1]


def factorize(n: int) -> Dict[int, int]:
    """``{prime: exponent}`` of ``n >= 1`` by trial division (fast for the smooth numbers used here)."""
    factors: Dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def divisors_between(factors: Dict[int, int], low: int, high: int) -> List[int]:
    """The divisors ``d`` of the number with prime factorization ``factors`` with ``low <= d <= high``."""
    found = [1]
    for prime, exponent in factors.items():
        grown = []
        for d in found:
            value = d
            for _ in range(exponent + 1):
                if value > high:
                    break
                grown.append(value)
                value *= prime
        found = grown
    return sorted(d for d in found if d >= low)


def _multiply(a: Dict[int, int], b: Dict[int, int]) -> Dict[int, int]:
    out = dict(a)
    for p, e in b.items():
        out[p] = out.get(p, 0) + e
    return out


def _divide(a: Dict[int, int], b: Dict[int, int]) -> Dict[int, int]:
    out = dict(a)
    for p, e in b.items():
        out[p] -= e
    return {p: e for p, e in out.items() if e}


def lcm(values: Iterable[int]) -> int:
    return reduce(lambda x, y: x * y // math.gcd(x, y), values, 1)


class BatchSearch:
    """The 0.1 search over one set of micro-batch sizes (their factorizations computed once)."""

    def __init__(self, micro_batches: Sequence[int]):
        self.micro_batches = sorted(set(int(m) for m in micro_batches))
        self._factors = {m: factorize(m) for m in self.micro_batches}
        self.lcm = lcm(self.micro_batches)
        lcm_factors: Dict[int, int] = {}
        for f in self._factors.values():
            for p, e in f.items():
                lcm_factors[p] = max(lcm_factors.get(p, 0), e)
        self._lcm_factors = lcm_factors

    def candidates(self, max_batch: int) -> Dict[int, Dict[int, int]]:
        """Candidate batch sizes -> their factorization: each base (the micro-batch sizes and
        their lcm when it fits) times the largest highly composite number keeping it
        ``<= max_batch``. Factorizations come from the parts, so no large number is factored."""
        bases = [(m, self._factors[m]) for m in self.micro_batches if m <= max_batch]
        if self.lcm <= max_batch and self.lcm not in self._factors:
            bases.append((self.lcm, self._lcm_factors))
        out: Dict[int, Dict[int, int]] = {}
        for base, factors in bases:
            h = largest_highly_composite(max_batch // base)
            out.setdefault(base * h, _multiply(factors, factorize(h)))
        return dict(sorted(out.items()))

    def valid_gpus(self, batch: int, min_gpus: int, max_gpus: int,
                   factors: Optional[Dict[int, int]] = None) -> List[int]:
        """GPU counts ``g`` in ``[min_gpus, max_gpus]`` with ``m × g`` dividing ``batch`` for some
        micro-batch size ``m``, ascending. ``factors``: ``batch``'s factorization if known."""
        factors = factorize(batch) if factors is None else factors
        valid = set()
        for m in self.micro_batches:
            if batch % m == 0:
                valid.update(divisors_between(_divide(factors, self._factors[m]), min_gpus, max_gpus))
        return sorted(valid)

    def best(self, max_batch: int, min_gpus: int, max_gpus: int, prefer_larger: bool
             ) -> Tuple[Optional[int], List[int]]:
        """``(batch, valid GPU counts)`` of the candidate valid for the most GPU counts (ties by
        ``prefer_larger``); ``(None, [])`` when no candidate runs on any count in range."""
        best_key, best = None, (None, [])
        for batch, factors in self.candidates(max_batch).items():
            valid = self.valid_gpus(batch, min_gpus, max_gpus, factors)
            if not valid:
                continue
            key = (len(valid), batch if prefer_larger else -batch)
            if best_key is None or key > best_key:
                best_key, best = key, (batch, valid)
        return best


def largest_dividing(values: Sequence[int], n: int) -> Optional[int]:
    """The largest of ``values`` dividing ``n`` (None when none does)."""
    for v in sorted(set(values), reverse=True):
        if n % v == 0:
            return v
    return None
