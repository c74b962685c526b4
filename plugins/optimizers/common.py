"""Pieces shared by this package's optimizer plugins: the ZeRO rule, building torch.optim classes.

Option extraction and rule helpers that other optimizer plugins need too are the kernel's
(:mod:`dsplug.config.params`). Nothing here imports torch at module level: plugin modules import
this at discovery time.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable

from dsplug.config.params import partitions_optimizer_states, section_of, selected_optimizer_type, value_of, zero_stage

#: The top-level key that lets ZeRO run an optimizer DeepSpeed has not tested with it.
ALLOW_UNTESTED_KEY = "zero_allow_untested_optimizer"


# ----------------------------------------------------------------------------- config rules
def allows_untested_optimizer(config) -> bool:
    value = getattr(config, ALLOW_UNTESTED_KEY, None)
    if value is None:
        value = section_of(config, ALLOW_UNTESTED_KEY)
    return value is True


def optimizer_offloaded(config) -> bool:
    """``zero_optimization.offload_optimizer.device`` is cpu or nvme."""
    offload = value_of(section_of(config, "zero_optimization"), "offload_optimizer")
    device = value_of(offload, "device")
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
