"""The ``comet`` monitor: a Comet experiment (``pip install dsplug[comet]``).

The experiment comes from ``comet_ml.start`` with the section's api_key / workspace / project /
experiment_key / mode / online; ``online=false`` stores an offline archive (its directory is
Comet's own setting, e.g. ``COMET_OFFLINE_DIRECTORY``). Like DeepSpeed, each tag is sent at
most once per ``samples_log_interval`` samples: a tag is logged the first time it is seen and
then whenever at least that many samples have passed since it was last logged.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from dsplug import PluginSpec

from .config import CometConfig
from .events import Event, MonitorObserver, build_client_monitor

class SamplesLogInterval:
    """Decides per tag whether enough samples passed since it was last sent."""

    def __init__(self, interval: int):
        self.interval = interval
        self._last: Dict[str, int] = {}

    def due(self, tag: str, samples: int) -> bool:
        last = self._last.get(tag)
        if last is None or samples - last >= self.interval:
            self._last[tag] = samples
            return True
        return False


#: comet's background samplers of host metrics (cpu, gpu, network, disk, CO2) cost measurable
#: step time on small hosts; they are off unless their COMET_AUTO_LOG_* variable turns them on.
_SAMPLERS = {"log_env_cpu": "COMET_AUTO_LOG_ENV_CPU", "log_env_gpu": "COMET_AUTO_LOG_ENV_GPU",
             "log_env_network": "COMET_AUTO_LOG_ENV_NETWORK", "log_env_disk": "COMET_AUTO_LOG_ENV_DISK",
             "auto_log_co2": "COMET_AUTO_LOG_CO2"}


def _quiet_experiment_config(comet_ml) -> dict:
    if not hasattr(comet_ml, "ExperimentConfig"):
        return {}
    off = {key: False for key, env in _SAMPLERS.items() if env not in os.environ}
    return {"experiment_config": comet_ml.ExperimentConfig(**off)} if off else {}


class CometWriter(MonitorObserver):
    section = "comet"

    def __init__(self, config: CometConfig, comet_ml):
        super().__init__()
        if not hasattr(comet_ml, "start"):
            raise RuntimeError(
                f"comet: comet_ml {getattr(comet_ml, '__version__', '?')} is too old (it has no comet_ml.start); "
                "upgrade it with: pip install -U dsplug[comet]")
        try:
            self.experiment = comet_ml.start(
                api_key=config.api_key,
                workspace=config.workspace,
                project_name=config.project,
                experiment_key=config.experiment_key,
                mode=config.mode,
                online=config.online,
                **_quiet_experiment_config(comet_ml),
            )
        except Exception as exc:  # comet raises ValueError / its own ExperimentNotFound etc.
            raise RuntimeError(
                f"comet: could not start the experiment (project={config.project!r}, "
                f"workspace={config.workspace!r}, mode={config.mode!r}, online={config.online!r}): {exc}. "
                "Give comet.api_key or COMET_API_KEY, or set comet.online=false to log offline"
            ) from exc
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.schedule = SamplesLogInterval(config.samples_log_interval)

    def _write(self, events: List[Event]) -> None:
        for tag, value, step in events:
            if self.schedule.due(tag, step):
                self.experiment.log_metric(tag, value, step=step)

    def _flush(self) -> None:
        self.experiment.flush()

    def _close(self) -> None:
        self.experiment.end()


def build(config: CometConfig, context) -> Optional[CometWriter]:
    return build_client_monitor(config, context, "comet_ml", "comet", lambda comet_ml: CometWriter(config, comet_ml))


def specs():
    """This monitor's spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="monitor",
            name="comet",
            section="comet",
            schema=CometConfig,
            factory=build,
            summary="Comet experiment, online or offline (pip install dsplug[comet])",
        )
    ]
