"""DeepSpeed's ``deepspeed.monitor`` classes over the monitors plugin: built from section objects,
the sections' values as attributes, writing through the plugin's monitors when enabled."""
from __future__ import annotations

import csv
import importlib
import os
import sys
import types

import pytest

from dsplug.plugins.monitors.deepspeed_monitor import (CometMonitor, DeepSpeedMonitorConfig, TensorBoardMonitor,
                                                       WandbMonitor, csvMonitor)
from dsplug.plugins.monitors.events import MissingExtraError
from dsplug.runtime.config import DeepSpeedConfig


def test_monitor_config_defaults_are_deepspeeds():
    defaults = DeepSpeedMonitorConfig()
    assert (defaults.tensorboard.enabled, defaults.tensorboard.output_path, defaults.tensorboard.job_name) == \
        (False, "", "DeepSpeedJobName")
    assert (defaults.csv_monitor.enabled, defaults.csv_monitor.job_name) == (False, "DeepSpeedJobName")
    assert (defaults.wandb.enabled, defaults.wandb.group, defaults.wandb.team, defaults.wandb.project) == \
        (False, None, None, "deepspeed")
    assert (defaults.comet.enabled, defaults.comet.samples_log_interval) == (False, 100)
    assert defaults.enabled is False
    assert DeepSpeedMonitorConfig(wandb={"enabled": True}).enabled is True


def test_sections_of_a_deepspeed_config_build_the_monitors():
    config = DeepSpeedConfig({"train_batch_size": 2, "wandb": {"enabled": False, "group": "g", "team": "t",
                                                               "project": "p"}, "tensorboard": {}})
    wandb = WandbMonitor(config.monitor_config.wandb)
    assert (wandb.enabled, wandb.group, wandb.team, wandb.project, wandb.writer) == (False, "g", "t", "p", None)
    tb = TensorBoardMonitor(config.monitor_config.tensorboard)
    assert (tb.enabled, tb.output_path, tb.job_name, tb.summary_writer) == (False, "", "DeepSpeedJobName", None)
    tb.write_events([("loss", 1.0, 1)])  # disabled: nothing happens


def test_enabled_csv_monitor_writes_deepspeeds_files(tmp_path):
    monitor = csvMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    assert (monitor.enabled, monitor.output_path, monitor.job_name) == (True, str(tmp_path), "job")
    monitor.write_events([("Train/Samples/train_loss", 0.5, 8), ("Train/Samples/train_loss", 0.25, 16)])
    monitor.close()
    with open(os.path.join(tmp_path, "job", "Train_Samples_train_loss.csv")) as f:
        assert list(csv.reader(f)) == [["step", "train_loss"], ["8", "0.5"], ["16", "0.25"]]


def test_disabled_csv_monitor_creates_nothing(tmp_path):
    monitor = csvMonitor({"enabled": False, "output_path": str(tmp_path), "job_name": "job"})
    monitor.write_events([("a", 1.0, 1)])
    assert monitor.writer is None and os.listdir(tmp_path) == []


def test_enabled_monitor_without_its_library_fails_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingExtraError, match="dsplug\\[tensorboard\\]"):
        TensorBoardMonitor({"enabled": True})


def test_comet_monitor_starts_the_experiment_with_the_sections_values(monkeypatch):
    calls = []

    class Experiment:
        def set_name(self, name):
            calls.append(("set_name", name))

        def flush(self):
            pass

        def end(self):
            calls.append(("end",))

    fake = types.ModuleType("comet_ml")
    fake.start = lambda **kwargs: calls.append(("start", kwargs)) or Experiment()
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    key = "a" * 32
    monitor = CometMonitor({"enabled": True, "samples_log_interval": 42, "project": "p", "workspace": "w",
                            "api_key": "k", "experiment_name": "n", "experiment_key": key, "mode": "get_or_create",
                            "online": True})
    assert (monitor.enabled, monitor.samples_log_interval) == (True, 42)
    assert isinstance(monitor.experiment, Experiment)
    start = calls[0][1]
    assert (start["api_key"], start["workspace"], start["experiment_key"], start["mode"], start["online"]) == \
        ("k", "w", key, "get_or_create", True)
    assert calls[1] == ("set_name", "n")
    monitor.close()
    assert calls[-1] == ("end",)
    disabled = CometMonitor({})
    assert (disabled.enabled, disabled.samples_log_interval, disabled.experiment) == (False, 100, None)


@pytest.mark.parametrize("path, name", [("dsplug.monitor.tensorboard", "TensorBoardMonitor"),
                                        ("dsplug.monitor.wandb", "WandbMonitor"),
                                        ("dsplug.monitor.csv_monitor", "csvMonitor"),
                                        ("dsplug.monitor.comet", "CometMonitor"),
                                        ("dsplug.monitor.config", "DeepSpeedMonitorConfig")])
def test_served_at_deepspeeds_paths(path, name):
    from dsplug.plugins.monitors import deepspeed_monitor

    assert getattr(importlib.import_module(path), name) is getattr(deepspeed_monitor, name)
