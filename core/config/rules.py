"""Cross-section rules: callables ``rule(config, report)`` run after every section is parsed.

Plugins add their own through ``PluginSpec.rules``; these are the kernel's. A rule reads the
parsed :class:`~dsplug.config.DsplugConfig` and records errors with the JSON path at fault.
"""
from __future__ import annotations


def communication_dtype_consistent(config, report) -> None:
    k = config.kernel
    if k.fp32_allreduce and k.communication_data_type not in (None, "fp32"):
        report.error(
            "communication_data_type",
            f"{k.communication_data_type!r} contradicts fp32_allreduce=true; drop one of them "
            "(fp32_allreduce is the older spelling of communication_data_type='fp32')",
        )


KERNEL_RULES = (communication_dtype_consistent,)
