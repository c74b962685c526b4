"""Tuners: which candidate to run next, and when to stop.

All three see the same pool of candidates that survived pruning and differ only in the order:

* :class:`GridSearchTuner` -- in the pool's order (ZeRO stage, then micro-batch size, then knobs);
* :class:`RandomTuner` -- uniformly at random (seeded by the config's ``seed`` when it has one);
* :class:`ModelBasedTuner` -- the first :data:`ModelBasedTuner.INIT` at random, then always the
  untried candidate a cost model predicts best. The cost model is ridge regression (a least-squares
  fit with a small penalty, solved exactly) of the score -- ``log(metric)`` for throughput and
  FLOPS, ``-log(latency)`` -- on the features of :func:`features`: the log2 micro-batch size and
  its square (so a curve with a peak can be represented), a one-hot ZeRO stage, the log10 of
  numeric knobs and 0/1 for boolean ones. It is refit after every result. With as few points as a
  tuning produces this is a coarse guide, not an oracle: it ranks by what resembles the best
  results so far. (DeepSpeed's model-based tuner fits an XGBoost ranker instead.)

:class:`Budget` applies ``tuner_num_trials`` (experiments run, failures included) and
``tuner_early_stopping`` (experiments in a row that did not beat the best so far).
"""
from __future__ import annotations

import abc
import math
import random
from typing import Callable, Dict, List, Optional, Sequence

from .space import Candidate

HIGHER_IS_BETTER = {"latency": False, "throughput": True, "flops": True}


def score(metric: str, value: Optional[float]) -> Optional[float]:
    """The number tuners maximise: the metric itself, negated for latency. None stays None."""
    if value is None:
        return None
    return float(value) if HIGHER_IS_BETTER[metric] else -float(value)


class Tuner(abc.ABC):
    """Hands out candidates from a pool, one at a time, each once."""

    def __init__(self, candidates: Sequence[Candidate], metric: str, seed: Optional[int] = None):
        self.pending: List[Candidate] = list(candidates)
        self.metric = metric
        self.rng = random.Random(seed)
        self.observed: Dict[Candidate, Optional[float]] = {}  # candidate -> metric value (None: failed)

    def has_next(self) -> bool:
        return bool(self.pending)

    def next(self) -> Candidate:
        choice = self._choose()
        self.pending.remove(choice)
        return choice

    def observe(self, cand: Candidate, value: Optional[float]) -> None:
        self.observed[cand] = value

    @abc.abstractmethod
    def _choose(self) -> Candidate:
        """The next candidate, one of ``self.pending``."""


class GridSearchTuner(Tuner):
    def _choose(self) -> Candidate:
        return self.pending[0]


class RandomTuner(Tuner):
    def _choose(self) -> Candidate:
        return self.rng.choice(self.pending)


def features(cand: Candidate, knob_keys: Sequence[str]) -> List[float]:
    """The cost model's inputs for ``cand`` (see the module docstring); ``knob_keys`` fixes their order."""
    lm = math.log2(cand.micro_batch)
    row = [1.0, lm, lm * lm] + [1.0 if cand.stage == s else 0.0 for s in (1, 2, 3)]
    knobs = dict(cand.knobs)
    for key in knob_keys:
        value = knobs.get(key)
        if isinstance(value, bool):
            row.append(1.0 if value else 0.0)
        elif isinstance(value, (int, float)) and value > 0:
            row.append(math.log10(value))
        else:
            row.append(0.0)
    return row


def ridge_fit(rows: Sequence[Sequence[float]], targets: Sequence[float], penalty: float = 1e-3) -> List[float]:
    """Weights minimising ``|X w - y|^2 + penalty * |w[1:]|^2`` (the intercept is not penalised),
    from the normal equations, solved by Gaussian elimination with partial pivoting."""
    n = len(rows[0])
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for row, y in zip(rows, targets):
        for i in range(n):
            b[i] += row[i] * y
            for j in range(n):
                a[i][j] += row[i] * row[j]
    for i in range(1, n):
        a[i][i] += penalty
    a[0][0] += 1e-12
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    w = [0.0] * n
    for i in range(n - 1, -1, -1):
        s = b[i] - sum(a[i][j] * w[j] for j in range(i + 1, n))
        w[i] = s / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0
    return w


def predict(weights: Sequence[float], row: Sequence[float]) -> float:
    return sum(w * x for w, x in zip(weights, row))


class ModelBasedTuner(Tuner):
    #: candidates chosen at random before the cost model is trusted
    INIT = 2

    def __init__(self, candidates, metric, seed=None):
        super().__init__(candidates, metric, seed)
        self.knob_keys = sorted({k for c in candidates for k, _ in c.knobs})
        self.last_predictions: Dict[Candidate, float] = {}

    def _choose(self) -> Candidate:
        measured = [(c, v) for c, v in self.observed.items() if v is not None and v > 0]
        if len(measured) < self.INIT:
            return self.rng.choice(self.pending)
        rows = [features(c, self.knob_keys) for c, _ in measured]
        targets = [math.log(v) if HIGHER_IS_BETTER[self.metric] else -math.log(v) for _, v in measured]
        weights = ridge_fit(rows, targets)
        self.last_predictions = {c: predict(weights, features(c, self.knob_keys)) for c in self.pending}
        # best prediction; ties keep the pool's order
        return max(self.pending, key=lambda c: (self.last_predictions[c], -self.pending.index(c)))


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}


def make_tuner(kind: str, candidates, metric: str, seed: Optional[int] = None) -> Tuner:
    return TUNERS[kind](candidates, metric, seed)


def explore(tuner: Tuner, budget: "Budget", evaluate: Callable[[Candidate], Optional[float]]) -> None:
    """Run candidates in the tuner's order until the pool is empty or the budget says stop;
    ``evaluate(candidate)`` runs one and returns its metric value (None: it failed)."""
    while tuner.has_next() and not budget.exhausted():
        cand = tuner.next()
        value = evaluate(cand)
        tuner.observe(cand, value)
        budget.record(value)


class Budget:
    """``tuner_num_trials`` and ``tuner_early_stopping`` over one whole tuning (all phases)."""

    def __init__(self, num_trials: int, early_stopping: int, metric: str):
        self.num_trials, self.early_stopping, self.metric = num_trials, early_stopping, metric
        self.trials = 0
        self.since_best = 0
        self.best: Optional[float] = None  # best score so far
        self.stop_reason: Optional[str] = None

    def record(self, value: Optional[float]) -> bool:
        """Count one experiment with its metric value (None: failed); True when it is the new best."""
        self.trials += 1
        s = score(self.metric, value)
        if s is not None and (self.best is None or s > self.best):
            self.best, self.since_best = s, 0
            return True
        self.since_best += 1
        return False

    def exhausted(self) -> bool:
        if self.trials >= self.num_trials:
            self.stop_reason = f"tuner_num_trials reached ({self.num_trials} experiments)"
        elif self.since_best >= self.early_stopping:
            self.stop_reason = (f"early stopping: {self.since_best} experiments in a row without a better result "
                                f"(tuner_early_stopping {self.early_stopping})")
        return self.stop_reason is not None
