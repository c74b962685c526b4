"""Pieces shared by the optimizer plugins: option extraction, range checks, the ZeRO rule.

Nothing here imports torch at module level: plugin modules import this at discovery time.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional

from dsplug.config.schema import extra_of, fields_of, is_auto

#: The top-level key that lets ZeRO run an optimizer DeepSpeed has not tested with it.
ALLOW_UNTESTED_KEY = "zero_allow_untested_optimizer"


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


# ----------------------------------------------------------------------------- config rules
def _section(config, name: str):
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(name)
        except (KeyError, TypeError):
            return None
    return getattr(config, name, None)


def _attr(obj, name: str):
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def selected_optimizer_type(config) -> Optional[str]:
    """``optimizer.type`` of a parsed config (section object or dict), or None."""
    value = _attr(_section(config, "optimizer"), "type")
    return value if isinstance(value, str) else None


def zero_stage(config):
    """``zero_optimization.stage`` as configured, for messages (0 when absent): DeepSpeed's number or
    the name of a stage plugin."""
    stage = _attr(_section(config, "zero_optimization"), "stage")
    return 0 if stage is None or isinstance(stage, bool) else stage


def partitions_optimizer_states(config) -> bool:
    """Whether the selected ZeRO stage steps flat slices of the optimizer state (its traits say:
    DeepSpeed's 1-3 do, 0 does not)."""
    if hasattr(config, "selection"):
        from dsplug.contracts.zero_stage import selected_traits

        traits = selected_traits(config)
        return traits is not None and traits.partitions_optimizer_states
    return str(zero_stage(config)) in ("1", "2", "3")  # a plain dict: DeepSpeed's numbers


def allows_untested_optimizer(config) -> bool:
    value = getattr(config, ALLOW_UNTESTED_KEY, None)
    if value is None:
        value = _section(config, ALLOW_UNTESTED_KEY)
    return value is True


def optimizer_offloaded(config) -> bool:
    """``zero_optimization.offload_optimizer.device`` is cpu or nvme."""
    offload = _attr(_section(config, "zero_optimization"), "offload_optimizer")
    device = _attr(offload, "device")
    return isinstance(device, str) and device.lower() in ("cpu", "nvme")


def untested_with_zero(names: Iterable[str], described_as: str, tested_when_offloaded: bool = False):
    """A spec rule: refuse this optimizer with ZeRO stage > 0 unless explicitly allowed.

    DeepSpeed only vouches for its own optimizers (Adam, AdamW, Lamb, ...) under ZeRO and asserts
    ``zero_allow_untested_optimizer`` for any other. ``tested_when_offloaded``: ZeRO-Offload swaps
    in a tested CPU implementation (DeepSpeed does this for Adagrad). The rule acts only when
    ``optimizer.type`` selects one of ``names``, so it is safe to run for every installed plugin.
    """
    wanted = {n.lower() for n in names}

    def rule(config, report) -> None:
        chosen = selected_optimizer_type(config)
        if chosen is None or chosen.strip().lower() not in wanted:
            return
        if tested_when_offloaded and optimizer_offloaded(config):
            return
        stage = zero_stage(config)
        if partitions_optimizer_states(config) and not allows_untested_optimizer(config):
            report.error(
                "optimizer.type",
                f"{chosen!r} ({described_as}) is not tested with ZeRO and zero_optimization.stage "
                f"is {stage}. Set \"{ALLOW_UNTESTED_KEY}\": true at the top level of the config to "
                "use it anyway, choose a ZeRO-tested optimizer (Adam, AdamW, Lamb), or set "
                "zero_optimization.stage to 0.",
            )

    rule.__name__ = f"untested_with_zero[{described_as}]"
    return rule


# ----------------------------------------------------------------------------- torch classes
def call_torch_optimizer(cls, params, options: Dict[str, Any], type_name: str):
    """``cls(params, **options)``.

    An argument the installed torch does not know (a switch added in a later release, such as
    ``fused``) is dropped while it holds its "off" value (None / False) and refused, naming the
    key, otherwise. Errors torch raises for bad values are re-raised naming the optimizer.
    """
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {}
    for key, value in options.items():
        if key in accepted or takes_any:
            kwargs[key] = value
        elif value is not None and value is not False:
            raise ValueError(
                f"optimizer.params.{key} = {value!r}: the installed torch "
                f"(torch.optim.{cls.__name__}) does not accept {key!r}; remove it or upgrade torch"
            )
    try:
        return cls(params, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"optimizer.type = {type_name!r}: torch.optim.{cls.__name__} rejected "
            f"optimizer.params {kwargs!r}: {exc}"
        ) from exc
