"""Schemas of the sections the monitors own: ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``."""
from __future__ import annotations

import re
from typing import Optional

from dsplug.config.schema import field, schema


@schema
class TensorBoardConfig:
    enabled: bool = field(False, doc="write TensorBoard event files (needs the tensorboard package)")
    output_path: Optional[str] = field(
        "", doc="directory for the logs; empty or null: the directory the training script was launched from")
    job_name: str = field("DeepSpeedJobName", doc="name of this job: a new directory inside output_path")


@schema
class CsvMonitorConfig:
    enabled: bool = field(False, doc="write one CSV file per metric")
    output_path: Optional[str] = field(
        "", doc="directory for the files; empty or null: the directory the training script was launched from")
    job_name: str = field("DeepSpeedJobName", doc="name of this job: a new directory inside output_path")


@schema
class WandbConfig:
    enabled: bool = field(False, doc="log to Weights & Biases (needs the wandb package)")
    group: Optional[str] = field(None, doc="W&B group: runs of one group are shown together")
    team: Optional[str] = field(None, doc="W&B team (entity) owning the project")
    project: str = field("deepspeed", doc="W&B project name")


MODES = ("get_or_create", "create", "get")


def _experiment_key_ok(key) -> Optional[str]:
    if key is not None and not re.fullmatch(r"[A-Za-z0-9]{32,50}", key):
        return f"an experiment key must be 32 to 50 letters or digits (got {len(key)} characters)"
    return None


@schema
class CometConfig:
    enabled: bool = field(False, doc="log to Comet (needs the comet_ml package)")
    samples_log_interval: int = field(
        100, ge=0, doc="send a metric again only after this many more samples have been processed")
    project: Optional[str] = field(None, doc="Comet project name (default: Comet's own, e.g. COMET_PROJECT_NAME)")
    workspace: Optional[str] = field(None, doc="Comet workspace (default: the user's)")
    api_key: Optional[str] = field(None, doc="Comet API key; better given as COMET_API_KEY than in a file")
    experiment_name: Optional[str] = field(None, doc="display name of the experiment")
    experiment_key: Optional[str] = field(
        None, check=_experiment_key_ok, doc="key of the experiment: 32 to 50 letters or digits")
    online: Optional[bool] = field(None, doc="false: store an offline experiment locally (Comet's default: true)")
    mode: Optional[str] = field(None, choices=MODES, doc="get / create / get_or_create (Comet's default)")
