"""DeepSpeed's ``deepspeed.monitor`` names over this plugin's monitors.

Served (``dsplug_api_modules``) at ``deepspeed.monitor`` and its submodules ``.config``
(:class:`DeepSpeedMonitorConfig`), ``.tensorboard`` (:class:`TensorBoardMonitor`), ``.wandb``
(:class:`WandbMonitor`), ``.csv_monitor`` (:class:`csvMonitor`) and ``.comet`` (:class:`CometMonitor`).

Each DeepSpeed-style monitor is built from its section object (``DeepSpeedConfig(...).monitor_config.
tensorboard`` or a dict), exposes the section's values as attributes (``enabled``, ``output_path``,
``job_name`` …) and, when enabled on rank 0, writes through this plugin's monitor of that section
(the same files and client-library calls as an engine's monitor); ``write_events([(tag, value,
step), ...])`` writes, ``flush()`` / ``close()`` release. Disabled, or on another rank, nothing is
created and ``write_events`` does nothing. An enabled monitor whose client library is missing fails
with the install hint of the engine's monitors.
"""
from __future__ import annotations

import types
from typing import Any, Iterable, Optional

from dsplug.config.schema import parse

from . import comet_monitor, csv_monitor, tensorboard_monitor, wandb_monitor
from .config import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig

#: section name -> (schema, factory(config, context) of this plugin's monitor)
SECTIONS = {
    "tensorboard": (TensorBoardConfig, tensorboard_monitor.build),
    "wandb": (WandbConfig, wandb_monitor.build),
    "csv_monitor": (CsvMonitorConfig, csv_monitor.build),
    "comet": (CometConfig, comet_monitor.build),
}


def _section(name: str, value: Any):
    """The parsed section: a dict (or None: the defaults) is parsed with the plugin's schema; a parsed
    section object (of this schema or duck-typed, e.g. from ``DeepSpeedConfig.monitor_config``) is kept."""
    schema = SECTIONS[name][0]
    if value is None:
        value = {}
    return parse(schema, value, name) if isinstance(value, dict) else value


class DeepSpeedMonitorConfig:
    """``DeepSpeedMonitorConfig(tensorboard=..., wandb=..., csv_monitor=..., comet=...)``: each section
    a dict or parsed section (missing: its defaults); ``enabled`` is true when any monitor is."""

    def __init__(self, tensorboard=None, wandb=None, csv_monitor=None, comet=None):
        self.tensorboard = _section("tensorboard", tensorboard)
        self.wandb = _section("wandb", wandb)
        self.csv_monitor = _section("csv_monitor", csv_monitor)
        self.comet = _section("comet", comet)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in SECTIONS)


def _rank() -> int:
    from dsplug import comm

    return comm.get_rank() if comm.is_initialized() else 0


class SectionMonitor:
    """Base of DeepSpeed's monitor classes: the section's values as attributes and, when enabled on
    rank 0, the plugin's monitor (``writer``) doing the writing."""

    section = ""

    def __init__(self, monitor_config):
        config = _section(self.section, monitor_config)
        self.monitor_config = config
        self.enabled = bool(config.enabled)
        self.writer = None
        if self.enabled:
            # the plugin's factory checks the client library on every rank and builds on rank 0 only
            self.writer = SECTIONS[self.section][1](config, types.SimpleNamespace(rank=_rank()))

    def write_events(self, event_list: Iterable) -> None:
        if self.writer is not None:
            self.writer.write_events(list(event_list))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TensorBoardMonitor(SectionMonitor):
    section = "tensorboard"

    def __init__(self, tensorboard_config):
        super().__init__(tensorboard_config)
        self.output_path = self.monitor_config.output_path
        self.job_name = self.monitor_config.job_name
        #: torch's SummaryWriter on the writing rank (None elsewhere)
        self.summary_writer = getattr(self.writer, "summary_writer", None)


class csvMonitor(SectionMonitor):  # noqa: N801 - DeepSpeed's name
    section = "csv_monitor"

    def __init__(self, csv_config):
        super().__init__(csv_config)
        self.output_path = self.monitor_config.output_path
        self.job_name = self.monitor_config.job_name
        self.log_dir: Optional[str] = getattr(self.writer, "log_dir", None)


class WandbMonitor(SectionMonitor):
    section = "wandb"

    def __init__(self, wandb_config):
        super().__init__(wandb_config)
        self.group = self.monitor_config.group
        self.team = self.monitor_config.team
        self.project = self.monitor_config.project


class CometMonitor(SectionMonitor):
    section = "comet"

    def __init__(self, comet_config):
        super().__init__(comet_config)
        self.samples_log_interval = self.monitor_config.samples_log_interval
        #: the comet_ml experiment on the writing rank (None elsewhere)
        self.experiment = getattr(self.writer, "experiment", None)


__all__ = ["CometMonitor", "DeepSpeedMonitorConfig", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
