"""Schema of the ``zero_optimization`` section (every key DeepSpeed documents) and its rules.

Legacy forms accepted with a deprecation warning:
* ``"zero_optimization": true`` / ``false`` -> ``{"stage": 1}`` / ``{"stage": 0}``;
* ``cpu_offload: true`` -> ``offload_optimizer: {"device": "cpu"}``;
* ``cpu_offload_param: true`` (and the spelling ``cpu_offload_params``) -> ``offload_param: {"device": "cpu"}``;
* ``offload_param: null`` / ``offload_optimizer: null`` -> the section left out (no offload);
* ``cpu_offload_use_pin_memory`` -> ``pin_memory`` of both offload sections.
"""
from __future__ import annotations

import json
from typing import List, Optional, Union

from dsplug.config.schema import boolean_from_string, field, is_auto, schema

BIG = 10**9


def _stage_value(value) -> Optional[str]:
    """``stage``: DeepSpeed's 0-3, or the name of any installed ``zero_stage`` plugin (checked
    against the registry by :func:`zero_stage_installed`)."""
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        return f"{value!r} is not a ZeRO stage: give 0, 1, 2, 3 or the name of an installed zero_stage plugin"
    if isinstance(value, str) and (not value or value != value.strip()):
        return f"{value!r} is not a ZeRO stage name"
    return None


@schema
class OffloadParamConfig:
    device: str = field("none", doc="where parameter partitions live: none, cpu or nvme")
    nvme_path: Optional[str] = field(None, doc="directory of the swap files; required with device=nvme "
                                     "(DeepSpeed's default is null too: no guessed directory)")
    pin_memory: bool = field(False, doc="page-locked host buffers (with an accelerator)")
    buffer_count: int = field(5, ge=1, doc="number of buffers for swapping parameters in")
    buffer_size: int = field(10**8, ge=1, doc="elements per swap buffer")
    max_in_cpu: int = field(BIG, ge=0, doc="parameter elements kept in CPU memory with device=nvme")


@schema
class OffloadOptimizerConfig:
    device: str = field("none", doc="where optimizer states live: none, cpu or nvme")
    nvme_path: Optional[str] = field(None, doc="directory of the swap files; required with device=nvme "
                                     "(DeepSpeed's default is null too: no guessed directory)")
    pin_memory: bool = field(False, doc="page-locked host buffers (with an accelerator)")
    buffer_count: int = field(4, ge=1, doc="buffers in the pool for swapping optimizer states")
    fast_init: bool = field(False, doc="initialise the nvme swap files lazily")
    ratio: float = field(1.0, ge=0.0, le=1.0, doc="fraction of the optimizer step done on the CPU")
    pipeline_read: bool = field(False, doc="overlap reading the next sub-group with the current step")
    pipeline_write: bool = field(False, doc="overlap writing the previous sub-group with the current step")

    @property
    def pipeline(self) -> bool:
        """Whether swapping overlaps the step in either direction (DeepSpeed's derived attribute)."""
        return self.pipeline_read or self.pipeline_write


@schema
class ZeroConfig:
    stage: Union[int, str] = field(0, check=_stage_value,
                                   doc="0 off; 1 optimizer states; 2 + gradients; 3 + parameters; or the name of "
                                       "another installed zero_stage plugin")
    allgather_partitions: bool = field(True, doc="all-gather updated partitions (else broadcasts)")
    allgather_bucket_size: int = field(5 * 10**8, ge=1, doc="elements all-gathered at a time")
    overlap_comm: bool = field(False, doc="overlap gradient reduction with backward (left out: true at stage 3, "
                                          "false otherwise, as DeepSpeed decides)")
    reduce_scatter: bool = field(True, doc="reduce gradients with reduce-scatter (else all-reduce)")
    reduce_bucket_size: int = field(5 * 10**8, ge=1, auto=True, doc="elements reduced at a time")
    contiguous_gradients: bool = field(True, doc="copy gradients into one contiguous buffer")
    load_from_fp32_weights: bool = field(True, doc="restore fp32 master weights from the checkpoint's fp32 copy")
    grad_hooks: bool = field(True, doc="stage 1: reduce gradients from backward hooks")
    round_robin_gradients: bool = field(False, doc="stages 1/2: flatten each group's parameters round-robin over "
                                        "ranks, so successive layers' gradient reductions go to different ranks")
    offload_param: OffloadParamConfig = field(factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(factory=OffloadOptimizerConfig)
    sub_group_size: int = field(BIG, ge=1, doc="elements of optimizer state stepped (and swapped) together")
    stage3_max_live_parameters: int = field(BIG, ge=0, aliases=("max_live_parameters",),
                                            doc="parameters resident per rank before releasing")
    stage3_max_reuse_distance: int = field(BIG, ge=0, aliases=("max_reuse_distance",),
                                           doc="keep a parameter if reused within this many parameters")
    stage3_prefetch_bucket_size: int = field(5 * 10**7, ge=0, auto=True, aliases=("prefetch_bucket_size",),
                                             doc="elements prefetched ahead of use")
    stage3_param_persistence_threshold: int = field(10**5, ge=0, auto=True,
                                                    aliases=("param_persistence_threshold",),
                                                    doc="parameters smaller than this stay whole on every rank")
    stage3_model_persistence_threshold: int = field(2**63 - 1, ge=0, aliases=("model_persistence_threshold",),
                                                    doc="total elements of persistent parameters allowed")
    stage3_gather_16bit_weights_on_model_save: bool = field(
        False, aliases=("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
        doc="gather the full 16-bit weights in save_16bit_model()")
    stage3_module_granularity_threshold: int = field(0, ge=0, doc="treat modules below this size as leaves")
    elastic_checkpoint: bool = field(False, doc="checkpoints loadable at another world size", inert='ZeRO elastic checkpointing is deprecated, DeepSpeed no longer supports it at stage 3; dsplug checkpoints always reload at another world size')
    ignore_unused_parameters: bool = field(True, doc="tolerate parameters that get no gradient")
    legacy_stage1: bool = field(False, doc="DeepSpeed's older stage 1 implementation")
    memory_efficient_linear: bool = field(True, doc="stage 3: memory-efficient linear autograd function", inert='stage 3 uses the standard linear autograd function')
    use_multi_rank_bucket_allreduce: bool = field(True, doc="bucketed all-reduce across ranks", inert='buckets are reduced one collective each')
    zero_hpz_partition_size: int = field(1, ge=1, doc="ZeRO++ hpZ (stage 3): ranks per group keeping a secondary "
                                         "copy of the parameters, so backward gathers stay in the group; must "
                                         "divide the world size (1 = off)")
    zero_quantized_weights: bool = field(False, doc="ZeRO++ qwZ (stage 3): forward/backward parameter all-gathers "
                                         "send int8 block-quantized weights")
    zero_quantized_nontrainable_weights: bool = field(False, doc="ZeRO++ (stage 3): qwZ for the frozen "
                                                      "(requires_grad=False) parameters only")
    zero_quantized_gradients: bool = field(False, doc="ZeRO++ qgZ (stage 3): gradient reduce-scatter as an "
                                           "all-to-all of int8 block-quantized gradients")
    mics_shard_size: int = field(-1, ge=-1, doc="MiCS shard group size (-1 = off)")
    mics_hierarchical_params_gather: bool = field(False, doc="MiCS hierarchical all-gather", inert='MiCS is not available')
    log_trace_cache_warnings: bool = field(False, doc="stage 3: warn when the module trace changes")
    pipeline_loading_checkpoint: bool = field(False, doc="stage 3 with pipeline parallelism: load module weights "
                                              "from the checkpoint into the partitions",
                                              inert="dsplug's pipeline engine loads ZeRO-3 checkpoints as any other")

    @staticmethod
    def __legacy__(data, path, report):
        """Rewrite DeepSpeed's early forms into the modern one, warning with the modern text."""
        if isinstance(data, bool):
            modern = {"stage": 1 if data else 0}
            report.warn(path, f"\"{path}\": {json.dumps(data)} is deprecated; write \"{path}\": {json.dumps(modern)}")
            return modern
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "overlap_comm" not in data and str(data.get("stage")) == "3":
            data["overlap_comm"] = True  # DeepSpeed's default depends on the stage: on at 3, off below
        for key in ("offload_param", "offload_optimizer"):
            if key in data and data[key] is None:  # DeepSpeed's "no offload section", as leaving it out
                del data[key]
        pin = data.pop("cpu_offload_use_pin_memory", None)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                         ("cpu_offload_params", "offload_param")):
            if old not in data:
                continue
            value = data.pop(old)
            flag = boolean_from_string(value, f"{path}.{old}", report)
            value = value if flag is None else flag
            if not isinstance(value, bool):
                report.error(f"{path}.{old}", f"{value!r} is not valid: expected a boolean (legacy key; use {new})")
                continue
            if new in data:
                report.error(f"{path}.{old}", f"given together with {new}; keep only {new}")
                continue
            if value:
                section = {"device": "cpu"}
                if pin is not None:
                    section["pin_memory"] = pin
                data[new] = section
                report.warn(f"{path}.{old}", f"\"{old}\": true is deprecated; write \"{new}\": {json.dumps(section)}")
            else:
                report.warn(f"{path}.{old}", f"\"{old}\": false is deprecated; leave out \"{new}\" instead")
        if pin is not None and not any(k in data for k in ("offload_optimizer", "offload_param")):
            report.warn(f"{path}.cpu_offload_use_pin_memory", "deprecated and ignored without cpu_offload; "
                        "use offload_optimizer.pin_memory")
        return data


# ------------------------------------------------------------------------------------ rules
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
               "zero_quantized_gradients")


def zeropp_rules(config, report) -> None:
    """ZeRO++ (qwZ / qgZ / hpZ, :mod:`dsplug.plugins.zero.stage3.zeropp`) works at stage 3 only, as in
    DeepSpeed; hpZ's partition size must divide the world size (when it is known here; the stage
    checks it again against the real one)."""
    zero = config.sections.get("zero_optimization")
    if zero is None:
        return
    if not is_auto(zero.stage) and str(zero.stage) != "3":
        for key in ZEROPP_KEYS:
            value = getattr(zero, key)
            default = 1 if key == "zero_hpz_partition_size" else False
            if value != default:
                report.error(f"zero_optimization.{key}", f"ZeRO++ ({key}) needs ZeRO stage 3, as in DeepSpeed "
                             f"(zero_optimization.stage is {zero.stage}, {key} is {json.dumps(value)}); set "
                             f"stage 3 or leave it at {json.dumps(default)}")
    hpz = zero.zero_hpz_partition_size
    world = getattr(config, "world_size", None)
    if hpz > 1 and world and world % hpz:
        report.error("zero_optimization.zero_hpz_partition_size",
                     f"{hpz} does not divide the world size {world}: hpZ keeps a secondary copy of the parameters "
                     "per group of that many consecutive ranks (1 turns it off)")
    if zero.mics_shard_size != -1:
        report.error("zero_optimization.mics_shard_size", "MiCS is not available in dsplug yet; leave it at -1")


def _either(names: List[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _stages_with(config, accepts) -> str:
    """The installed stages whose traits ``accepts`` (names in order), for messages."""
    from dsplug.contracts.zero_stage import traits_of_spec

    names = [p.name for p in config.registry.all() if p.category == "zero_stage" and accepts(traits_of_spec(p))]
    names.sort(key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))
    return _either(names) if names else "(none installed)"


def offload_devices_installed(config, report) -> None:
    """Each offload section names an installed device that the selected stage can use: the stage's
    traits say which sections it honours and which device capabilities it needs."""
    from dsplug.contracts.offload import capabilities_of
    from dsplug.contracts.zero_stage import selected_traits

    zero = config.sections.get("zero_optimization")
    if zero is None:
        return
    traits = None if is_auto(zero.stage) else selected_traits(config)
    for key, what in (("offload_param", "offloading parameters"), ("offload_optimizer", "offloading the optimizer")):
        section = getattr(zero, key)
        device = section.device
        if device == "none":
            continue
        provided = config.registry.find("offload_device", device)
        if provided is None:
            report.error(f"zero_optimization.{key}.device", config.registry.miss_message("offload_device", device)
                         + " ('none' turns offload off)")
        if traits is None:
            continue  # stage not installed (reported by zero_stage_installed) or "auto"
        needs = getattr(traits, key)
        capabilities = capabilities_of(provided) if provided is not None else None
        if needs is None:
            stages = _stages_with(config, lambda t: getattr(t, key) is not None)
            if key == "offload_param":
                report.error(f"zero_optimization.{key}", f"{what} needs stage {stages} "
                             f"(zero_optimization.stage is {zero.stage})")
            else:
                report.error(f"zero_optimization.{key}.device",
                             f"{device!r} needs ZeRO stage {stages} (zero_optimization.stage is {zero.stage}: it "
                             "keeps no partitioned optimizer state to offload)")
        elif capabilities is not None and not needs <= capabilities:
            missing = ", ".join(sorted(needs - capabilities))
            stages = _stages_with(config, lambda t: getattr(t, key) is not None and getattr(t, key) <= capabilities)
            report.error(f"zero_optimization.{key}.device",
                         f"{device!r} needs ZeRO stage {stages} (zero_optimization.stage is {zero.stage}, which "
                         f"needs a {missing} device for {key}; {device!r} declares "
                         f"{', '.join(sorted(capabilities)) or 'no capabilities'})")
    section = zero.offload_optimizer
    if traits is not None and section.device != "none" and section.ratio < 1.0 and traits.offload_optimizer is not None \
            and not traits.offload_ratio:
        report.error("zero_optimization.offload_optimizer.ratio",
                     f"{section.ratio}: a partial offload needs ZeRO stage {_stages_with(config, lambda t: t.offload_ratio)} "
                     f"(zero_optimization.stage is {zero.stage}); leave ratio at 1")


def zero_stage_installed(config, report) -> None:
    zero = config.sections.get("zero_optimization")
    if zero is None or is_auto(zero.stage):
        return
    if config.registry.find("zero_stage", str(zero.stage)) is None:
        report.error("zero_optimization.stage", config.registry.miss_message("zero_stage", str(zero.stage)))


def gradient_sum_supported(config, report) -> None:
    """``gradient_allreduce_op: "sum"`` needs a stage declaring ``gradient_sum`` (stages 0-2; as in
    DeepSpeed, not stage 3)."""
    from dsplug.contracts.zero_stage import selected_traits

    if config.kernel.gradient_allreduce_op != "sum":  # choices are stored lower-case
        return
    zero = config.sections.get("zero_optimization")
    if zero is not None and is_auto(zero.stage):
        return
    traits = selected_traits(config)
    if traits is not None and not traits.gradient_sum:
        stage = zero.stage if zero is not None else 0
        name = f"ZeRO stage {stage}" if str(stage).isdigit() else f"the ZeRO stage {stage!r}"
        report.error("gradient_allreduce_op", f"'sum' is not supported with {name}: it averages gradients "
                     f"over the ranks; 'sum' works with stage {_stages_with(config, lambda t: t.gradient_sum)} "
                     "(or leave gradient_allreduce_op at 'mean')")


RULES = (zeropp_rules, offload_devices_installed, zero_stage_installed, gradient_sum_supported)
