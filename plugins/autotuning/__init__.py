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
  (the launcher asks the ``dsplug_launch_override`` hook of :mod:`.plugin`);
* :mod:`.api`       -- the names of ``dsplug.autotuning`` (= ``deepspeed.autotuning``).

:mod:`.plugin` (entry point ``autotuning``) registers it. Importing this package is cheap (no torch).
"""
