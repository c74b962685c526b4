"""Autotuning: ``dsplug launch --autotuning tune|run`` and the ``autotuning`` config section.

* :mod:`.config`    -- the ``autotuning`` section (DeepSpeed's keys and defaults);
* :mod:`.observer`  -- the engine observer an experiment's config turns on: times the profile
  steps (FLOPS from the flops profiler), or counts parameters and activation bytes, writes the
  result and ends the run;
* :mod:`.space`     -- the user's config and arguments -> candidate experiment configs;
* :mod:`.memory`    -- pruning with the model-state estimator (``dsplug_estimate_model_state_bytes``);
* :mod:`.tuner`     -- gridsearch / random / model_based order, trial budget, early stopping;
* :mod:`.runner`    -- each experiment as a real ``dsplug launch`` subprocess; the progress lines;
* :mod:`.report`    -- the ranked results table;
* :mod:`.autotuner` -- ``Autotuner`` / ``run_autotuning``, run for ``dsplug launch --autotuning``
  (the launcher asks the ``dsplug_launch_override`` hook below);
* :mod:`.api`       -- the names of ``dsplug.autotuning`` (= ``deepspeed.autotuning``).

Entry point ``autotuning = "dsplug.plugins.autotuning"``. Importing this package is cheap (no torch).
"""
from dsplug import PluginSpec, hookimpl
from dsplug.descriptors import ApiModule

from .config import AutotuningConfig


def build_observer(section, context):
    from .observer import build_observer as build

    return build(section, context)


@hookimpl
def dsplug_observers():
    return [PluginSpec(category="observer", name="autotuning", section="autotuning", schema=AutotuningConfig,
                       factory=build_observer,
                       summary="autotuning experiments: measures latency / throughput / FLOPS between the profile "
                               "steps (dsplug launch --autotuning tune|run)")]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.autotuning", "dsplug.plugins.autotuning.api")]


@hookimpl
def dsplug_launch_override(args, resources):
    """``dsplug launch --autotuning tune|run``: tune (and then train) instead of one launch."""
    if not getattr(args, "autotuning", ""):
        return None
    from .autotuner import run_autotuning

    return run_autotuning(args, resources)
