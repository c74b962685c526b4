"""dsplug entry point: the ``jsonl_monitor`` monitor and the schema of the section it owns.

Importing this module is cheap (no torch): the monitor itself is imported by the factory.
"""
from __future__ import annotations

from typing import Optional

from dsplug import PluginSpec, hookimpl
from dsplug.config.schema import field, schema

#: the config section this plugin owns, the plugin's name and the prefix of its checkpoint keys
SECTION = "jsonl_monitor"


@schema
class JsonlMonitorConfig:
    enabled: bool = field(False, doc="write one JSON line per event")
    output_path: Optional[str] = field("", doc="directory for the file; empty or null: the launch directory")
    job_name: str = field("DeepSpeedJobName", doc="name of this job: a new directory inside output_path")
    ema_beta: float = field(0.9, ge=0.0, lt=1.0, doc="loss EMA smoothing: ema = beta * ema + (1 - beta) * loss")


def build(config: JsonlMonitorConfig, context) -> Optional["JsonlMonitor"]:  # noqa: F821
    """``factory(section, context)``: nothing when disabled or on ranks other than 0."""
    if not config.enabled or getattr(context, "rank", 0) != 0:
        return None
    from .monitor import JsonlMonitor, events_path

    return JsonlMonitor(events_path(config.output_path, config.job_name), ema_beta=config.ema_beta)


@hookimpl
def dsplug_monitors():
    return [
        PluginSpec(
            category="monitor",
            name=SECTION,
            section=SECTION,
            schema=JsonlMonitorConfig,
            factory=build,
            summary="one JSON line per event, with a loss EMA kept across checkpoints (third-party plugin)",
        )
    ]
