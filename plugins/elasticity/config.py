"""The ``elasticity`` config section and DeepSpeed's ``deepspeed.elasticity.config`` names.

:class:`ElasticitySection` is the strict schema the config system parses the section with
(unknown keys, wrong types and out-of-range values are errors naming the key);
:class:`ElasticityConfig` is DeepSpeed's class of the same section, built from a plain dict,
with DeepSpeed's attribute names (``max_acceptable_batch_size``, ``micro_batches``,
``prefer_larger_batch_size``). The errors are DeepSpeed's three classes; here they are also
``ValueError`` s, as every dsplug config error is.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Union

from dsplug.config.kernel_schema import MAX_BATCH, MAX_MICRO
from dsplug.config.schema import Report, field, parse, schema, to_dict

from . import constants as C


class ElasticityError(ValueError):
    """Base class of the elastic-training errors (DeepSpeed's ``ElasticityError``)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The current world size is not one the elastic batch size divides into."""


SUPPORTED_VERSIONS = (0.1, 0.2)


def version_number(value) -> float:
    """``0.1`` / ``"0.2"`` as a float; ValueError for anything that is not a number."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a version number")
    return float(value)


def _check_version(value) -> str:
    try:
        number = version_number(value)
    except ValueError:
        return "must be 0.1 or 0.2 (the elastic batch logic to use)"
    if number > C.LATEST_ELASTICITY_VERSION:
        return (f"elasticity version {value} is newer than this runtime supports (up to "
                f"{C.LATEST_ELASTICITY_VERSION}); use 0.1 or 0.2")
    if number not in SUPPORTED_VERSIONS:
        return "must be 0.1 or 0.2 (0.1: any GPU count; 0.2: whole nodes, with model parallelism)"
    return ""


def _check_micro_batches(values) -> str:
    return "" if values else "must list at least one micro-batch size (e.g. [2, 4, 6])"


def _gpus_ordered(v: Dict[str, Any]):
    if v["max_gpus"] < v["min_gpus"]:
        return "max_gpus", f"{v['max_gpus']} is less than min_gpus={v['min_gpus']}"
    return None


def _micro_within_max(v: Dict[str, Any]):
    too_big = [m for m in v["micro_batch_sizes"] if m > v["max_train_batch_size"]]
    if too_big:
        return ("micro_batch_sizes", f"{too_big} exceed max_train_batch_size={v['max_train_batch_size']}: every "
                "micro-batch size must be <= max_train_batch_size")
    return None


def _model_parallel_needs_v02(v: Dict[str, Any]):
    if v["model_parallel_size"] > 1 and version_number(v["version"]) != 0.2:
        return ("model_parallel_size", f"{v['model_parallel_size']} needs \"version\": 0.2 (elasticity version "
                f"{v['version']} does not support model-parallel training)")
    return None


def _nodes_hold_model_parallel_groups(v: Dict[str, Any]):
    if version_number(v["version"]) == 0.2 and v["num_gpus_per_node"] % v["model_parallel_size"]:
        return ("num_gpus_per_node", f"{v['num_gpus_per_node']} is not divisible by model_parallel_size="
                f"{v['model_parallel_size']}: in elasticity 0.2 every node holds whole model-parallel groups")
    return None


def _v02_has_a_node(v: Dict[str, Any]):
    if version_number(v["version"]) == 0.2 and v["max_gpus"] < v["num_gpus_per_node"]:
        return ("max_gpus", f"{v['max_gpus']} is less than one node (num_gpus_per_node={v['num_gpus_per_node']}); "
                "elasticity 0.2 scales by whole nodes")
    return None


@schema
class ElasticitySection:
    """The ``elasticity`` section (DeepSpeed's keys and defaults)."""

    enabled: bool = field(C.ENABLED_DEFAULT, doc="compute the batch sizes from this section (elastic training)")
    max_train_batch_size: int = field(C.MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT, ge=1, le=MAX_BATCH,
                                      doc="largest acceptable train_batch_size (required when enabled)")
    micro_batch_sizes: List[int] = field(C.MICRO_BATCHES_DEFAULT, ge=1, le=MAX_MICRO, check=_check_micro_batches,
                                         doc="acceptable train_micro_batch_size_per_gpu values (required when enabled)")
    min_gpus: int = field(C.MIN_GPUS_DEFAULT, ge=1, doc="fewest GPUs (processes) the job may run on")
    max_gpus: int = field(C.MAX_GPUS_DEFAULT, ge=1, doc="most GPUs (processes) the job may run on")
    min_time: int = field(C.MIN_TIME_DEFAULT, ge=0,
                          doc="minutes a resource scheduler should wait before scaling again (0: unknown); "
                              "a hint for the scheduler, not used by the training runtime")
    version: Union[float, str] = field(C.VERSION_DEFAULT, check=_check_version,
                                       doc="elastic batch logic: 0.1 (GPU counts) or 0.2 (whole nodes, model parallel)")
    ignore_non_elastic_batch_info: bool = field(
        C.IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT,
        doc="let the elastic batch sizes replace train_batch_size / train_micro_batch_size_per_gpu / "
            "gradient_accumulation_steps given outside this section (else a disagreement is an error)")
    prefer_larger_batch: bool = field(C.PREFER_LARGER_BATCH_DEFAULT, aliases=("prefer_large_batch",),
                                      doc="between batch sizes valid for as many GPU counts, take the larger")
    model_parallel_size: int = field(C.MODEL_PARALLEL_SIZE_DEFAULT, ge=1,
                                     doc="tensor / model-parallel size (version 0.2 only)")
    num_gpus_per_node: int = field(C.NUM_GPUS_PER_NODE_DEFAULT, ge=1,
                                   doc="GPUs per node: 0.2 counts GPUs in whole nodes (version 0.2 only)")

    __rules__ = (_gpus_ordered, _micro_within_max, _model_parallel_needs_v02, _nodes_hold_model_parallel_groups,
                 _v02_has_a_node)


#: keys DeepSpeed requires once ``enabled`` is true (their defaults only describe a disabled section)
REQUIRED_WHEN_ENABLED = (C.MAX_ACCEPTABLE_BATCH_SIZE, C.MICRO_BATCHES)


def missing_required(raw: Mapping[str, Any]) -> List[str]:
    """The keys an enabled section must give and ``raw`` lacks ([] when disabled)."""
    if not isinstance(raw, Mapping) or raw.get(C.ENABLED) is not True:
        return []
    return [key for key in REQUIRED_WHEN_ENABLED if key not in raw]


def parse_elasticity(raw) -> ElasticitySection:
    """The ``elasticity`` dict parsed and checked, or :class:`ElasticityConfigError` listing every problem."""
    report = Report("elasticity config")
    section = parse(ElasticitySection, raw, C.ELASTICITY, report)
    for key in missing_required(raw):
        report.error(f"{C.ELASTICITY}.{key}", "required when elasticity is enabled")
    if report.errors:
        if len(report.errors) == 1:
            raise ElasticityConfigError(f"invalid elasticity config: {report.errors[0]}")
        lines = "\n".join(f"  - {issue}" for issue in report.errors)
        raise ElasticityConfigError(f"invalid elasticity config: {len(report.errors)} errors\n{lines}")
    return section


class ElasticityConfig:
    """DeepSpeed's ``ElasticityConfig(param_dict)``: the ``elasticity`` dict, validated, under
    DeepSpeed's attribute names. Raises :class:`ElasticityConfigError` naming every bad key."""

    def __init__(self, param_dict: Mapping[str, Any]):
        section = parse_elasticity(dict(param_dict) if isinstance(param_dict, Mapping) else param_dict)
        self.section = section
        self.enabled = section.enabled
        self.max_acceptable_batch_size = section.max_train_batch_size
        self.micro_batches = list(section.micro_batch_sizes)
        self.min_gpus = section.min_gpus
        self.max_gpus = section.max_gpus
        self.min_time = section.min_time
        self.version = version_number(section.version)
        self.prefer_larger_batch_size = section.prefer_larger_batch
        self.ignore_non_elastic_batch_info = section.ignore_non_elastic_batch_info
        self.model_parallel_size = section.model_parallel_size
        self.num_gpus_per_node = section.num_gpus_per_node

    def to_dict(self) -> Dict[str, Any]:
        return to_dict(self.section)

    def repr(self) -> Dict[str, Any]:  # DeepSpeed's name
        return self.to_dict()

    def __repr__(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=4)


__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize",
           "ElasticitySection", "parse_elasticity"]
