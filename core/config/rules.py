"""Cross-section rules: callables ``rule(config, report)`` run after every section is parsed.

Plugins add their own through ``PluginSpec.rules``; these are the kernel's. A rule reads the
parsed :class:`~dsplug.config.DsplugConfig` and records errors with the JSON path at fault.
"""
from __future__ import annotations

import numbers

import attrs

from .schema import MAX_LR, _show, extra_of, to_dict


def communication_dtype_consistent(config, report) -> None:
    k = config.kernel
    if k.fp32_allreduce and k.communication_data_type not in (None, "fp32"):
        report.error(
            "communication_data_type",
            f"{k.communication_data_type!r} contradicts fp32_allreduce=true; drop one of them "
            "(fp32_allreduce is the older spelling of communication_data_type='fp32')",
        )


def _lr_like(name: str) -> bool:
    return name == "lr" or name.endswith("_lr") or name == "learning_rate"


def learning_rates_in_range(config, report) -> None:
    """Every ``lr`` / ``*_lr`` key of ``optimizer.params`` and ``scheduler.params`` (one number or
    one per param group) is in ``0 .. MAX_LR``, whichever plugin owns the params: the built-ins
    declare ``le=MAX_LR`` on their fields, this catches a plugin schema that does not (torch.optim
    classes derived from signatures, third-party optimizers). A field the plugin already refused
    kept its default, so nothing is reported twice."""
    for key in ("optimizer", "scheduler"):
        selected = getattr(config, key, None)
        if selected is None or not attrs.has(type(selected.params)):
            continue
        params = to_dict(selected.params)
        params.update(extra_of(selected.params))
        for name, value in params.items():
            if not isinstance(name, str) or not _lr_like(name):
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if not isinstance(v, numbers.Real) or isinstance(v, bool):
                    continue  # "auto", null: for the plugin's schema
                why = "must be >= 0" if v < 0 else f"must be <= {MAX_LR}" if v > MAX_LR else None
                if why:
                    at = f" (got {_show(v)})" if isinstance(value, (list, tuple)) else ""
                    report.error(f"{key}.params.{name}", f"{_show(value)} is not valid: {why}{at} (a learning rate)")
                    break


KERNEL_RULES = (communication_dtype_consistent, learning_rates_in_range)
