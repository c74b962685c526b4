"""Machinery shared by the built-in LR schedules.

Every schedule here is a pure function of ``last_batch_iteration`` (``t``): the index of the last
batch trained, ``-1`` before the first. The engine calls ``step()`` once per optimizer step,
*after* the optimizer has stepped, so the value a schedule computes for ``t`` is the lr the
optimizer uses for its step number ``t + 1``; the value written at construction (``t = -1``)
is the lr of the first step.

Because the state is one integer, ``state_dict()`` is ``{"last_batch_iteration": t}`` (plus
what a schedule cannot recompute, see WarmupCosineLR), the same dict DeepSpeed saves, so
checkpoints move both ways. ``load_state_dict()`` also writes the restored lr (and momentum)
into the optimizer, so a resumed run's next step uses exactly the lr the uninterrupted run
would have used, whatever order the optimizer and the scheduler states are restored in.

Nothing here imports torch: schedules only read and write ``optimizer.param_groups``. An lr
stored as a tensor (torch's ``capturable`` optimizers) is updated in place with ``fill_``.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


# ------------------------------------------------------------------------------ value checks
def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def non_negative(value) -> Optional[str]:
    """Schema ``check`` for a number or a per-group list of numbers."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        return "must be a number, or a non-empty list with one number per parameter group"
    bad = [v for v in values if _is_number(v) and v < 0]
    return f"must be >= 0 (got {bad[0]!r})" if bad else None


def whole_steps(value, key: str, minimum: int) -> int:
    """``value`` as an int step count >= ``minimum`` (integral floats accepted, like JSON 2e3)."""
    if isinstance(value, bool) or not _is_number(value) or not float(value).is_integer():
        raise ValueError(f"{key} must be a whole number of steps >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value!r}")
    return int(value)


def non_negative_number(value, key: str) -> float:
    if not _is_number(value) or value < 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return float(value)


def per_group(value, n_groups: int, key: str) -> List[float]:
    """One float per parameter group from a number or a list of ``n_groups`` numbers."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{key} has {len(value)} values but the optimizer has {n_groups} parameter "
                f"group(s): give one number, or exactly one per group"
            )
        values = list(value)
    else:
        values = [value] * n_groups
    for v in values:
        if not _is_number(v):
            hint = ' ("auto" must be resolved before the schedule is built)' if v == "auto" else ""
            raise ValueError(f"{key} must be a number or a list of numbers, got {v!r}{hint}")
    return [float(v) for v in values]


def warmup_type_of(value) -> str:
    kind = str(value).lower() if isinstance(value, str) else value
    if kind not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {', '.join(map(repr, WARMUP_TYPES))}, got {value!r}")
    return kind


def iteration_of(value) -> int:
    if isinstance(value, bool) or not _is_number(value) or not float(value).is_integer() or value < -1:
        raise ValueError(f"last_batch_iteration must be an integer >= -1, got {value!r}")
    return int(value)


# ------------------------------------------------------------------ cross-field schema rules
Rule = Callable[[Dict[str, Any]], Iterable[Tuple[str, str]]]


def with_cross_field_rule(rule: Rule):
    """Class decorator: check ``rule`` whenever :func:`dsplug.config.schema.parse` reads this schema.

    ``rule(values)`` gets the parsed params (defaults filled in) and yields ``(key, message)``
    for every violated relation between fields. It only judges plain numbers: ``"auto"`` is left
    to the schedule's constructor, which applies the same rule again once it is resolved.
    """

    def attach(cls):
        cls.__rules__ = (rule,)
        return cls

    return attach


def steps_cover_warmup(values: Dict[str, Any]) -> Iterable[Tuple[str, str]]:
    """total_num_steps must not be shorter than warmup_num_steps."""
    total, warmup = values.get("total_num_steps"), values.get("warmup_num_steps")
    if _is_number(total) and _is_number(warmup) and total < warmup:
        yield "total_num_steps", (
            f"total_num_steps ({total}) must be >= warmup_num_steps ({warmup}): the schedule "
            "warms up over the first warmup_num_steps of the total_num_steps training steps"
        )


def ordered_pair(low_key: str, high_key: str) -> Rule:
    """A rule: ``values[low_key] <= values[high_key]`` (element-wise for per-group lists)."""

    def rule(values):
        low, high = values.get(low_key), values.get(high_key)
        lows = low if isinstance(low, (list, tuple)) else [low]
        highs = high if isinstance(high, (list, tuple)) else [high]
        if len(lows) == 1 and len(highs) > 1:
            lows = lows * len(highs)
        if len(highs) == 1 and len(lows) > 1:
            highs = highs * len(lows)
        if len(lows) != len(highs):
            return
        for lo, hi in zip(lows, highs):
            if _is_number(lo) and _is_number(hi) and lo > hi:
                yield high_key, f"{low_key} ({low!r}) must be <= {high_key} ({high!r})"
                return

    return rule


def all_rules(*rules: Rule) -> Rule:
    def rule(values):
        for r in rules:
            yield from r(values)

    return rule


def raise_on(rule: Rule, values: Dict[str, Any]) -> None:
    problems = [message for _, message in rule(values)]
    if problems:
        raise ValueError("; ".join(problems))


# ------------------------------------------------------------------------ optimizer access
def unwrap_optimizer(optimizer):
    """The object whose ``param_groups`` hold the lr: the optimizer, or a wrapper's ``.optimizer``."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(
        f"an LR schedule needs an optimizer with param_groups (a torch.optim.Optimizer, or a "
        f"wrapper exposing one as .optimizer); got {type(optimizer).__name__}"
    )


def _is_tensor_like(value) -> bool:
    return not isinstance(value, numbers.Number) and hasattr(value, "fill_")


def write_value(group: dict, key: str, value: float) -> None:
    current = group.get(key)
    if _is_tensor_like(current):
        current.fill_(value)
    else:
        group[key] = value


def read_lr(group: dict) -> float:
    return float(group["lr"])


def write_lrs(param_groups: Sequence[dict], lrs: Sequence[float]) -> List[float]:
    for group, lr in zip(param_groups, lrs):
        write_value(group, "lr", lr)
    return [read_lr(group) for group in param_groups]


def momentum_key(group: dict) -> Optional[str]:
    """Where a param group keeps its momentum: Adam-style ``betas[0]`` or SGD-style ``momentum``."""
    if "betas" in group:
        return "betas"
    if "momentum" in group:
        return "momentum"
    return None


def write_momenta(param_groups: Sequence[dict], momenta: Sequence[float], beta2: Optional[float] = None) -> None:
    """Each group's momentum: ``betas[0]`` (and ``betas[1]`` when ``beta2`` is given) of Adam-style
    groups, ``momentum`` of SGD-style ones."""
    for group, momentum in zip(param_groups, momenta):
        if momentum_key(group) == "betas":
            beta1, old_beta2 = group["betas"]
            new_beta2 = old_beta2 if beta2 is None else beta2
            if _is_tensor_like(beta1):
                beta1.fill_(momentum)
                if beta2 is not None and _is_tensor_like(old_beta2):
                    old_beta2.fill_(beta2)
                elif beta2 is not None:
                    group["betas"] = (beta1, new_beta2)
            else:
                group["betas"] = (momentum, new_beta2)
        else:
            write_value(group, "momentum", momentum)


def read_momenta(param_groups: Sequence[dict]) -> List[float]:
    out = []
    for group in param_groups:
        value = group["betas"][0] if momentum_key(group) == "betas" else group["momentum"]
        out.append(float(value))
    return out


# ------------------------------------------------------------------------------ base class
class LRSchedule:
    """Base of the built-in schedules: subclasses define ``lr_at(t)`` and call ``_apply()``
    at the end of ``__init__`` to write the lr of the current iteration into the optimizer."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        self.optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration = iteration_of(last_batch_iteration)
        self._last_lr: List[float] = []

    @property
    def num_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def lr_at(self, iteration: int) -> List[float]:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} does not define lr_at()")

    def get_lr(self) -> List[float]:
        """The lr of each param group for the current ``last_batch_iteration``."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> List[float]:
        """The lr last written into the optimizer, one per param group."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None, *, batch_iteration: Optional[int] = None):
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lr.

        ``batch_iteration=`` is accepted as well: DeepSpeed's OneCycle and LRRangeTest name the
        argument that way, its warmup schedules ``last_batch_iteration``.
        """
        if batch_iteration is not None:
            if last_batch_iteration is not None:
                raise TypeError("step() takes last_batch_iteration or batch_iteration, not both")
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = iteration_of(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = write_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "last_batch_iteration" not in state_dict:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected a dict with key "
                f"'last_batch_iteration' (as saved by state_dict()), got {got}"
            )
        self.last_batch_iteration = iteration_of(state_dict["last_batch_iteration"])
        self._apply()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


# ----------------------------------------------------------------------------- factories
def build(schedule_cls, schema_cls, optimizer, config, key_prefix: str = "scheduler.params"):
    """Factory body shared by the scheduler plugins: parsed params -> schedule object.

    ``config`` is an instance of ``schema_cls`` (a dict or None is parsed first). Values still
    ``"auto"`` are an error here: the engine resolves them before it builds the scheduler.
    """
    from dsplug.config.schema import ConfigError, Issue, parse, to_dict

    if config is None or isinstance(config, dict):
        config = parse(schema_cls, config or {}, key_prefix)
    params = to_dict(config)
    unresolved = [key for key, value in params.items() if value == "auto"]
    if unresolved:
        raise ConfigError([
            Issue(f"{key_prefix}.{key}",
                  '"auto" was not resolved: it is filled in by the engine (from the optimizer '
                  "and the training length, as Hugging Face's integration does); give a number "
                  "when nothing resolves it")
            for key in unresolved
        ])
    return schedule_cls(optimizer, **params)
