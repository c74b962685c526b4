"""What plugins selected by ``type`` + ``params`` (optimizers, schedulers) share about their config.

* :func:`options_of` -- the parsed ``params`` as keyword arguments for a factory;
* :func:`given`, :func:`cross_checks`, :func:`betas_check` -- pieces of a params schema's rules;
* :func:`selected_optimizer_type`, :func:`zero_stage` -- what a spec rule (``rule(config,
  report)``) reads from the rest of the config, from a parsed config or a plain dict.

Nothing here imports torch: plugin modules import this at discovery time.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .schema import extra_of, fields_of, is_auto


def options_of(config, type_name: str) -> Dict[str, Any]:
    """The parsed ``optimizer.params`` as keyword arguments (tuples kept as tuples).

    The engine resolves ``"auto"`` values before calling a factory; one left over is a bug in
    the caller, reported with the key at fault rather than passed on to torch.
    """
    if config is None:
        return {}
    options = {a.name: getattr(config, a.name) for a in fields_of(type(config))}
    options.update(extra_of(config))
    unresolved = sorted(k for k, v in options.items() if is_auto(v))
    if unresolved:
        keys = ", ".join(f"optimizer.params.{k}" for k in unresolved)
        raise ValueError(
            f"optimizer.type = {type_name!r}: {keys} is still \"auto\"; \"auto\" values are filled "
            "in by the engine (from the Hugging Face Trainer arguments) before the optimizer is "
            "built. Give concrete values when building the optimizer directly."
        )
    return options


def betas_check(value) -> Optional[str]:
    """``check=`` for a ``betas`` pair: each coefficient in [0, 1)."""
    bad = [b for b in value if not 0.0 <= b < 1.0]
    if bad:
        return f"each beta must be in [0, 1), got {bad[0]!r}"
    return None


def cross_checks(*checks: Callable[[dict], Optional[tuple]]):
    """A schema's ``__rules__``: rules that span several keys.

    :func:`dsplug.config.schema.parse` runs each ``check(values)`` on the parsed field values once
    every field is valid; it returns ``(key, message)`` for a problem or None. Values that are
    ``"auto"`` are left alone (``given`` skips them).
    """
    return tuple(checks)


def given(data: dict, key: str, kind=object):
    """``data[key]`` if present, concrete (not "auto") and an instance of ``kind``; else None."""
    value = data.get(key)
    if value is None or is_auto(value) or isinstance(value, bool) and kind is not bool:
        return None
    return value if isinstance(value, kind) else None


# ----------------------------------------------------------------------------- reading a config
def section_of(config, name: str):
    """Section ``name`` of a parsed config (its ``get``) or of a plain dict / object; None if absent."""
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(name)
        except (KeyError, TypeError):
            return None
    return getattr(config, name, None)


def value_of(obj, name: str):
    """Key or attribute ``name`` of a section (dict or parsed object); None if absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def selected_optimizer_type(config) -> Optional[str]:
    """``optimizer.type`` of a parsed config (section object or dict), or None."""
    value = value_of(section_of(config, "optimizer"), "type")
    return value if isinstance(value, str) else None


def zero_stage(config):
    """``zero_optimization.stage`` as configured, for messages (0 when absent): DeepSpeed's number
    or the name of a stage plugin."""
    stage = value_of(section_of(config, "zero_optimization"), "stage")
    return 0 if stage is None or isinstance(stage, bool) else stage


def partitions_optimizer_states(config) -> bool:
    """Whether the selected ZeRO stage steps flat slices of the optimizer state (its traits say:
    DeepSpeed's 1-3 do, 0 does not). ``config``: a parsed config, or a plain dict (DeepSpeed's
    numbers only)."""
    if hasattr(config, "selection"):
        from ..contracts.zero_stage import selected_traits

        traits = selected_traits(config)
        return traits is not None and traits.partitions_optimizer_states
    return str(zero_stage(config)) in ("1", "2", "3")
