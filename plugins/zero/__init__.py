"""ZeRO: the ``zero_optimization`` section and the stage plugins sharing one partitioning core."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .config import RULES, ZeroConfig


@hookimpl
def dsplug_config_sections():
    return [
        PluginSpec(
            category="section",
            name="zero_optimization",
            section="zero_optimization",
            schema=ZeroConfig,
            rules=RULES,
            summary="ZeRO settings; zero_optimization.stage selects a zero_stage plugin",
        )
    ]
