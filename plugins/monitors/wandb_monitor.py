"""The ``wandb`` monitor: a Weights & Biases run (``pip install dsplug[wandb]``).

The run is started with ``wandb.init(project=project, group=group, entity=team)``; everything
else (offline mode, run directory, API key) is configured the way wandb itself reads it, e.g.
``WANDB_MODE=offline`` and ``WANDB_DIR``. Each optimizer step is one ``run.log`` call holding all
of that step's tags, at ``step=global_samples``.
"""
from __future__ import annotations

import os

from typing import Dict, List, Optional

from dsplug import PluginSpec

from .config import WandbConfig
from .events import Event, MonitorObserver, build_client_monitor


def _quiet_settings(wandb_module) -> dict:
    """wandb's sampler of host metrics costs measurable step time on small hosts: off unless
    WANDB_X_DISABLE_STATS says otherwise."""
    if "WANDB_X_DISABLE_STATS" in os.environ or not hasattr(wandb_module, "Settings"):
        return {}
    try:
        return {"settings": wandb_module.Settings(x_disable_stats=True)}
    except Exception:  # an older client without that setting
        return {}


class WandbWriter(MonitorObserver):
    section = "wandb"

    def __init__(self, config: WandbConfig, wandb_module):
        super().__init__()
        try:
            self.run = wandb_module.init(project=config.project, group=config.group, entity=config.team,
                                         **_quiet_settings(wandb_module))
        except Exception as exc:  # wandb raises its own UsageError / CommError types
            raise RuntimeError(
                f"wandb: could not start a run for project {config.project!r} "
                f"(team={config.team!r}, group={config.group!r}): {exc}. Log in with `wandb login` "
                "or set WANDB_API_KEY, or set WANDB_MODE=offline to log locally"
            ) from exc

    def _write(self, events: List[Event]) -> None:
        by_step: Dict[int, Dict[str, float]] = {}
        for tag, value, step in events:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step)

    def _flush(self) -> None:
        """wandb streams to its own service process; there is nothing to hand over here."""

    def _close(self) -> None:
        self.run.finish()


def build(config: WandbConfig, context) -> Optional[WandbWriter]:
    return build_client_monitor(config, context, "wandb", "wandb", lambda wandb: WandbWriter(config, wandb))


def specs():
    """This monitor's spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="monitor",
            name="wandb",
            section="wandb",
            schema=WandbConfig,
            factory=build,
            summary="Weights & Biases run (pip install dsplug[wandb])",
        )
    ]
