"""The ``data_efficiency`` section: DeepSpeed's keys, defaults and the relations between them.

::

    data_efficiency: {enabled, seed,
      data_sampling: {enabled, num_epochs, num_workers, pin_memory,
        curriculum_learning: {enabled, data_cluster_path,
          curriculum_metrics: {<name>: {index_to_sample_path, index_to_metric_path, difficulty_type,
                                        clustering_type, min_difficulty, max_difficulty,
                                        schedule_type, schedule_config}}}},
      data_routing: {enabled,
        random_ltd: {enabled, total_layer_num, random_ltd_layer_num, random_ltd_layer_id,
                     model_mask_name, model_type, hidden_state_order,
                     random_ltd_schedule: {min_value, max_value, schedule_type,
                                           schedule_config: {require_steps, seq_per_step}},
                     layer_token_lr_schedule: {...}}}}

A feature is on when its ``enabled`` and every enclosing ``enabled`` are true (curriculum
sampling: ``data_efficiency``, ``data_sampling``, ``curriculum_learning``; random-LTD:
``data_efficiency``, ``data_routing``, ``random_ltd``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from dsplug.config.schema import field, schema

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


# ---------------------------------------------------------------- curriculum sampling
@schema
class CurriculumScheduleConfig:
    total_curriculum_step: Optional[int] = field(None, ge=1, doc="steps from min_difficulty to max_difficulty "
                                                                 "(fixed_linear, fixed_root)")
    difficulty_step: Optional[int] = field(None, ge=1, doc="the difficulty is rounded down to a multiple of this "
                                                           "(fixed_linear, fixed_root)")
    root_degree: Optional[int] = field(None, ge=1, doc="degree of the root (fixed_root; 1 is linear)")
    difficulty: Optional[List[int]] = field(None, doc="difficulty of each stage (fixed_discrete)")
    max_step: Optional[List[int]] = field(None, ge=0, doc="last step of each stage but the final one "
                                                          "(fixed_discrete)")


def _metric_rules(values):
    problems = []
    kind, cfg = values["schedule_type"], values["schedule_config"]
    if values["min_difficulty"] > values["max_difficulty"]:
        problems.append(("min_difficulty", f"{values['min_difficulty']} is above max_difficulty "
                                           f"{values['max_difficulty']}"))
    low, high = values["min_difficulty"], values["max_difficulty"]
    if values["difficulty_type"] == "percentile" and not 0 <= low <= high <= 100:
        problems.append(("max_difficulty", "percentiles run from 0 to 100 (min_difficulty <= max_difficulty <= 100)"))
    need = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
            "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
            "fixed_discrete": ("difficulty", "max_step"), "custom": ()}[kind]
    for key in need:
        if cfg[key] is None:
            problems.append((f"schedule_config.{key}", f"required by schedule_type {kind!r}"))
    if kind == "fixed_discrete" and cfg["difficulty"] is not None and cfg["max_step"] is not None:
        if len(cfg["difficulty"]) != len(cfg["max_step"]) + 1:
            problems.append(("schedule_config.difficulty", f"has {len(cfg['difficulty'])} entries; fixed_discrete "
                                                           f"needs one more than max_step ({len(cfg['max_step'])})"))
        if list(cfg["max_step"]) != sorted(cfg["max_step"]):
            problems.append(("schedule_config.max_step", "must be increasing"))
    if values["clustering_type"] == "schedule_based":
        if not values["index_to_sample_path"]:
            problems.append(("index_to_sample_path", "required with clustering_type 'schedule_based' (a file "
                                                     "written by DataAnalyzer)"))
        if values["difficulty_type"] == "value" and not values["index_to_metric_path"]:
            problems.append(("index_to_metric_path", "required with difficulty_type 'value' and clustering_type "
                                                     "'schedule_based' (a file written by DataAnalyzer)"))
    return problems or None


@schema
class CurriculumMetricConfig:
    index_to_sample_path: str = field("", doc="<metric>_index_to_sample (value) or "
                                              "<metric>_index_to_sample_percentile_merged (percentile), "
                                              "written by DataAnalyzer; the .npz suffix may be left out")
    index_to_metric_path: str = field("", doc="<metric>_index_to_metric written by DataAnalyzer")
    difficulty_type: str = field("value", choices=("value", "percentile"),
                                 doc="value: the max accepted metric value; percentile: the max accepted "
                                     "percentile of samples ordered by the metric")
    clustering_type: str = field("schedule_based", choices=("schedule_based", "single_cluster"),
                                 doc="schedule_based: sample only within the difficulty; single_cluster: every "
                                     "sample (the difficulty is applied by data post-processing)")
    min_difficulty: int = field(doc="difficulty at the first step")
    max_difficulty: int = field(doc="final difficulty")
    schedule_type: str = field(choices=SCHEDULE_TYPES, doc="pacing function from min to max difficulty; custom: "
                                                           "engine.set_custom_curriculum_learning_schedule")
    schedule_config: CurriculumScheduleConfig = field(factory=CurriculumScheduleConfig)

    __rules__ = (_metric_rules,)


def _curriculum_rules(values):
    if values["enabled"] and not values["curriculum_metrics"]:
        return ("curriculum_metrics", "is empty: name at least one metric")
    return None


@schema
class CurriculumLearningConfig:
    enabled: bool = field(False, doc="sample each global batch only from data within the current difficulty")
    data_cluster_path: str = field("", inert="clusters are rebuilt in memory from the index files; nothing is "
                                             "written there")
    curriculum_metrics: Dict[str, CurriculumMetricConfig] = field(factory=dict)

    __rules__ = (_curriculum_rules,)


@schema
class DataSamplingConfig:
    enabled: bool = field(False, doc="data sampling features (curriculum learning)")
    num_epochs: int = field(1000, ge=1, doc="the sampler stops after num_epochs * len(dataset) samples")
    num_workers: int = field(0, ge=0, doc="DataLoader worker processes of the training loader")
    pin_memory: bool = field(False, doc="DataLoader pin_memory of the training loader")
    curriculum_learning: CurriculumLearningConfig = field(factory=CurriculumLearningConfig)


# ---------------------------------------------------------------- random-LTD
@schema
class RandomLTDScheduleParams:
    require_steps: Optional[int] = field(None, ge=1, doc="steps from min_value to max_value")
    seq_per_step: int = field(1, ge=1, doc="kept tokens are a multiple of this (8 / 16 for tensor cores)")


@schema
class RandomLTDScheduleConfig:
    min_value: Optional[int] = field(None, ge=1, doc="kept tokens per sample at step 0")
    max_value: Optional[int] = field(None, ge=1, doc="kept tokens at the end (usually the sequence length)")
    schedule_type: str = field("fixed_linear", choices=("fixed_linear",))
    schedule_config: RandomLTDScheduleParams = field(factory=RandomLTDScheduleParams)


@schema
class LayerTokenLRConfig:
    enabled: bool = field(False, inert="Megatron-DeepSpeed's layer-token learning-rate schedule is not an engine "
                                       "feature; the consumed layer tokens are in the random-LTD state")
    total_layer_token: Optional[int] = field(None, ge=0)
    warmup_type: Optional[str] = field(None)
    warmup_layer_token: Optional[int] = field(None, ge=0)


def _ltd_rules(values):
    if not values["enabled"]:
        return None
    problems = []
    ids, total = list(values["random_ltd_layer_id"]), values["total_layer_num"]
    if total is None:
        problems.append(("total_layer_num", "required when random_ltd is enabled"))
    if values["random_ltd_layer_num"] != len(ids):
        problems.append(("random_ltd_layer_num", f"is {values['random_ltd_layer_num']} but random_ltd_layer_id "
                                                 f"lists {len(ids)} layers"))
    if len(set(ids)) != len(ids):
        problems.append(("random_ltd_layer_id", "lists a layer twice"))
    if total is not None and any(not 0 <= i < total for i in ids):
        problems.append(("random_ltd_layer_id", f"ids must be in 0..{total - 1} (total_layer_num {total})"))
    sched = values["random_ltd_schedule"]
    for key in ("min_value", "max_value"):
        if sched[key] is None:
            problems.append((f"random_ltd_schedule.{key}", "required when random_ltd is enabled"))
    if sched["schedule_config"]["require_steps"] is None:
        problems.append(("random_ltd_schedule.schedule_config.require_steps", "required when random_ltd is enabled"))
    if None not in (sched["min_value"], sched["max_value"]) and sched["min_value"] > sched["max_value"]:
        problems.append(("random_ltd_schedule.min_value", f"{sched['min_value']} is above max_value "
                                                          f"{sched['max_value']}"))
    return problems or None


@schema
class RandomLTDConfig:
    enabled: bool = field(False, doc="random layerwise token dropping in the wrapped layers")
    total_layer_num: Optional[int] = field(None, ge=1, doc="layers of the model (for the layer-token count)")
    random_ltd_layer_num: int = field(0, ge=0, doc="how many layers drop tokens (= len(random_ltd_layer_id))")
    random_ltd_layer_id: List[int] = field(factory=list, ge=0, doc="which wrapped layers drop tokens: the index of "
                                                                   "each among the model's RandomLayerTokenDrop "
                                                                   "layers, in module order")
    model_mask_name: Optional[str] = field(None, doc="keyword of the attention mask in the layer's forward")
    model_type: str = field("decoder", choices=("decoder", "encoder"))
    hidden_state_order: str = field("batch_seq_dim", choices=("batch_seq_dim", "seq_batch_dim"),
                                    doc="layout of the hidden states the layer takes first")
    random_ltd_schedule: RandomLTDScheduleConfig = field(factory=RandomLTDScheduleConfig)
    layer_token_lr_schedule: LayerTokenLRConfig = field(factory=LayerTokenLRConfig)

    __rules__ = (_ltd_rules,)


@schema
class DataRoutingConfig:
    enabled: bool = field(False, doc="data routing features (random-LTD)")
    random_ltd: RandomLTDConfig = field(factory=RandomLTDConfig)


@schema
class DataEfficiencyConfig:
    enabled: bool = field(False, doc="DeepSpeed's data efficiency library: curriculum sampling and random-LTD")
    seed: int = field(1234, doc="seed of the sampler's shuffles and random-LTD's token choice")
    data_sampling: DataSamplingConfig = field(factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = field(factory=DataRoutingConfig)


# ---------------------------------------------------------------- which features are on
def curriculum_on(config: DataEfficiencyConfig) -> bool:
    return bool(config.enabled and config.data_sampling.enabled and config.data_sampling.curriculum_learning.enabled)


def random_ltd_on(config: DataEfficiencyConfig) -> bool:
    return bool(config.enabled and config.data_routing.enabled and config.data_routing.random_ltd.enabled)


def enabled_but_off(config: DataEfficiencyConfig) -> List[str]:
    """Paths of ``enabled: true`` flags that an enclosing ``enabled: false`` switches off."""
    out = []
    sampling, routing = config.data_sampling, config.data_routing
    chains = (
        ("data_sampling", (config.enabled,), sampling.enabled),
        ("data_sampling.curriculum_learning", (config.enabled, sampling.enabled), sampling.curriculum_learning.enabled),
        ("data_routing", (config.enabled,), routing.enabled),
        ("data_routing.random_ltd", (config.enabled, routing.enabled), routing.random_ltd.enabled),
    )
    for path, outer, inner in chains:
        if inner and not all(outer):
            out.append(path)
    return out


def notice_enabled_but_off(config, report):
    """A config rule: a notice for each ``enabled: true`` switched off by an enclosing ``enabled: false``."""
    section = config.sections.get("data_efficiency")
    if section is None:
        return
    for path in enabled_but_off(section):
        report.notice(f"data_efficiency.{path}.enabled", "is true but an enclosing 'enabled' is false, so it is off")
