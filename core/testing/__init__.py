"""Test a dsplug plugin against its category's contract, in a real engine.

Two layers, both public:

* **helpers** (:mod:`dsplug.testing.harness`, no pytest needed): :func:`tiny_model`,
  :func:`tiny_batch`, :func:`tiny_engine` (an engine over a small MLP, built from a config dict
  and an optional registry), :func:`train_steps` (deterministic data chosen by the step number,
  so resumed and uninterrupted runs see the same batches), :func:`save_and_load`,
  :func:`make_registry` (register plugin modules that are not installed), :func:`plugin_state`
  (what an object contributes to a checkpoint) and :func:`assert_state_equal`; and
  (:mod:`dsplug.testing.ranks`) :func:`run_ranks`, which runs a function on N real ranks over gloo
  on 127.0.0.1 and returns each rank's result;
* **contract suites** (:mod:`dsplug.testing.suites`, pytest base classes):
  :class:`OptimizerContract`, :class:`SchedulerContract`, :class:`MonitorContract`,
  :class:`ObserverContract`, :class:`PrecisionContract`, :class:`CompressionContract`,
  :class:`SectionContract`; and (:mod:`dsplug.testing.stage_suites`) :class:`ZeroStageContract`,
  :class:`OffloadDeviceContract`, :class:`AcceleratorContract`.
  Subclass one in a ``Test*`` class, set ``plugin_name`` and ``section``, and pytest runs the
  category's checks against your plugin::

      from dsplug.testing import MonitorContract

      class TestJsonlMonitor(MonitorContract):
          plugin_name = "jsonl_monitor"
          section = {"enabled": True, "output_path": "{tmp_path}", "job_name": "job"}

``docs/writing-plugins.md`` shows a suite for every category.
"""
from __future__ import annotations

from .harness import (
    BASE_CONFIG,
    assert_state_equal,
    contract_problems,
    default_optimizer,
    has_state,
    lifecycle_hooks_of,
    make_registry,
    merge,
    plugin_state,
    save_and_load,
    tiny_batch,
    tiny_config,
    tiny_engine,
    tiny_loss,
    tiny_model,
    train_steps,
)
from .ranks import RankFailed, run_ranks

_SUITES = ("PluginContract", "OptimizerContract", "SchedulerContract", "MonitorContract", "ObserverContract",
           "PrecisionContract", "CompressionContract", "SectionContract")
_STAGE_SUITES = ("ZeroStageContract", "OffloadDeviceContract", "AcceleratorContract")

__all__ = ["BASE_CONFIG", "assert_state_equal", "contract_problems", "default_optimizer", "has_state",
           "lifecycle_hooks_of", "make_registry", "merge", "plugin_state", "save_and_load", "tiny_batch",
           "tiny_config", "tiny_engine", "tiny_loss", "tiny_model", "train_steps", "run_ranks", "RankFailed",
           *_SUITES, *_STAGE_SUITES]


def __getattr__(name):
    # the suites import pytest: load them only when asked for, so the helpers work without it
    if name in _SUITES:
        from . import suites

        return getattr(suites, name)
    if name in _STAGE_SUITES:
        from . import stage_suites

        return getattr(stage_suites, name)
    raise AttributeError(f"module 'dsplug.testing' has no attribute {name!r}")
