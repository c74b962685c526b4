"""The ``autotuning`` config section: DeepSpeed's keys and defaults, plus three dsplug keys.

The section plays two parts:

* in the user's config it configures the tuning that ``dsplug launch --autotuning tune|run``
  performs (metric, profile window, tuner, budget, micro-batch range ...);
* in each experiment's generated config the autotuner sets ``enabled``, ``metric_path`` (or
  ``model_info.profile`` with ``model_info_path``): that turns on the engine observer
  (:mod:`.observer`) which measures the run and ends it.

A training config may keep its ``autotuning`` section: without ``metric_path`` /
``model_info.profile`` nothing is measured and nothing ends early.
"""
from __future__ import annotations

from typing import Dict, Optional

from dsplug.config.schema import field, schema

METRICS = ("latency", "throughput", "flops")
TUNER_TYPES = ("gridsearch", "random", "model_based")
#: micro-batch bounds DeepSpeed documents for the tuner
DEFAULT_MAX_MICRO_BATCH = 1024
DEFAULT_MIN_MICRO_BATCH = 1


def _non_empty(value) -> Optional[str]:
    if value is not None and not str(value).strip():
        return "must be a non-empty path (or null for the default)"
    return None


def _arg_mappings(value) -> Optional[str]:
    if value is None:
        return None
    for key, flag in value.items():
        if not key.strip():
            return "has an empty config key; map dotted config paths (e.g. 'train_micro_batch_size_per_gpu') to flags"
        if not flag.startswith("-"):
            return (f"maps {key!r} to {flag!r}, which is not a command-line flag; give the script's flag "
                    f"(e.g. '--per_device_train_batch_size')")
    return None


@schema
class ModelInfoConfig:
    profile: bool = field(False, doc="set by the autotuner in its model-info run: measure the parameter count and "
                                     "activation bytes, write them to model_info_path and end the run")
    num_params: Optional[int] = field(None, ge=1, doc="the model's parameter count; when given the autotuner skips "
                                                      "its model-info run (activation memory is then taken as 0)")
    hidden_size: Optional[int] = field(None, ge=1, doc="the model's hidden size",
                                       inert="dsplug measures activation memory in the model-info run instead")
    num_layers: Optional[int] = field(None, ge=1, doc="the model's number of layers",
                                      inert="dsplug measures activation memory in the model-info run instead")


def _profile_window(values) -> Optional[tuple]:
    if values["end_profile_step"] < values["start_profile_step"]:
        return ("end_profile_step", f"{values['end_profile_step']} is less than start_profile_step "
                                    f"{values['start_profile_step']}; the profiled steps are start..end (inclusive)")
    return None


def _micro_batch_range(values) -> Optional[tuple]:
    lo, hi = values["min_train_micro_batch_size_per_gpu"], values["max_train_micro_batch_size_per_gpu"]
    if lo > hi:
        return ("min_train_micro_batch_size_per_gpu",
                f"{lo} is larger than max_train_micro_batch_size_per_gpu {hi}")
    return None


def _batch_range(values) -> Optional[tuple]:
    hi = values["max_train_batch_size"]
    if hi is not None and values["min_train_batch_size"] > hi:
        return ("min_train_batch_size", f"{values['min_train_batch_size']} is larger than max_train_batch_size {hi}")
    return None


def _profile_needs_path(values) -> Optional[tuple]:
    info = values["model_info"]
    if info and info.get("profile") and not values["model_info_path"]:
        return ("model_info_path", "is not set but model_info.profile is true: the model-info run needs a file to "
                                   "write to (the autotuner sets both)")
    return None


@schema
class AutotuningConfig:
    __rules__ = (_profile_window, _micro_batch_range, _batch_range, _profile_needs_path)

    enabled: bool = field(False, doc="measure this run as an autotuning experiment (set by the autotuner in the "
                                     "experiments' configs, with metric_path)")
    results_dir: Optional[str] = field("autotuning_results", check=_non_empty,
                                       doc="experiment results, the ranked summary and ds_config_optimal.json "
                                           "(relative to the launch directory; null: the default)")
    exps_dir: Optional[str] = field("autotuning_exps", check=_non_empty,
                                    doc="one folder per experiment: its description and generated ds_config "
                                        "(null: the default)")
    overwrite: bool = field(False, doc="re-run experiments whose results already exist (false: reuse them)")
    metric: str = field("throughput", choices=METRICS, case_insensitive=True,
                        doc="what ranks experiments: latency (ms per step, lower is better), throughput "
                            "(samples/s), flops (FLOPS per GPU)")
    start_profile_step: int = field(3, ge=0, doc="steps run before the measurement starts (warm-up)")
    end_profile_step: int = field(5, ge=0, doc="the last measured step (steps are counted from 0 in each run; "
                                               "start..end inclusive); the run ends after it")
    fast: bool = field(True, doc="tune ZeRO stage and micro-batch size only; false also tunes the stage's knobs "
                                 "(bucket sizes, overlap_comm, stage-3 prefetch ...)")
    max_train_batch_size: Optional[int] = field(None, ge=1, doc="largest global batch size an experiment may use")
    min_train_batch_size: int = field(1, ge=1, doc="smallest global batch size an experiment may use")
    max_train_micro_batch_size_per_gpu: int = field(DEFAULT_MAX_MICRO_BATCH, ge=1,
                                                    doc="largest micro-batch size tried")
    min_train_micro_batch_size_per_gpu: int = field(DEFAULT_MIN_MICRO_BATCH, ge=1,
                                                    doc="smallest micro-batch size tried")
    num_tuning_micro_batch_sizes: int = field(3, ge=1, doc="micro-batch sizes tried per ZeRO stage "
                                                           "(geometrically spaced from min to max)")
    tuner_type: str = field("model_based", choices=TUNER_TYPES, case_insensitive=True,
                            doc="order of the experiments: gridsearch (in order), random, model_based "
                                "(a cost model fit to the results picks the next)")
    tuner_early_stopping: int = field(5, ge=1, doc="stop after this many experiments without a better result")
    tuner_num_trials: int = field(50, ge=1, doc="the most experiments run in one tuning")
    arg_mappings: Optional[Dict[str, str]] = field(None, check=_arg_mappings,
                                                   doc="config path -> the script's flag that must carry its value "
                                                       "(e.g. {\"train_micro_batch_size_per_gpu\": "
                                                       "\"--per_device_train_batch_size\"})")
    mp_size: int = field(1, ge=1, doc="model-parallel size: data-parallel ranks = processes / mp_size")
    num_gpus: Optional[int] = field(None, ge=1, doc="processes per node for the experiments (default: the launch's)")
    num_nodes: Optional[int] = field(None, ge=1, doc="nodes for the experiments (default: the launch's)")
    metric_path: Optional[str] = field(None, check=_non_empty,
                                       doc="set by the autotuner: where this experiment writes its metrics")
    model_info_path: Optional[str] = field(None, check=_non_empty,
                                           doc="set by the autotuner: where the model-info run writes its findings")
    model_info: Optional[ModelInfoConfig] = field(None, doc="the model-info run (profile) or known model facts")
    device_memory: Optional[int] = field(None, ge=1,
                                         doc="dsplug: bytes of memory per device the memory pruning assumes "
                                             "(null: the accelerator's; on CPU the host memory divided by the "
                                             "processes per node)")
    experiment_timeout: Optional[float] = field(None, gt=0, le=10**7,
                                                doc="dsplug: seconds an experiment may run before it is stopped and "
                                                    "recorded as timed out (null: no limit)")
