"""Schemas of the seven ``compression_training`` entries (DeepSpeed's keys, defaults and ranges).

Six of them share a shape: ``shared_parameters`` (``enabled``, ``schedule_offset``, the method)
and ``different_groups`` (named groups, each with ``params``, ``modules`` and, for pruning,
``related_modules``). ``layer_reduction`` is flat. Patterns in ``modules`` are regular
expressions (see :mod:`.selection`); ``"*"`` (the default) means every Linear and Conv2d layer.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from dsplug.config.schema import field, schema

from .block_pattern import parse_block_pattern

ALL_LAYERS = ["*"]


def _block_pattern(value) -> Optional[str]:
    try:
        parse_block_pattern(value)
    except ValueError as exc:
        return str(exc)
    return None


def _group_list(section_key: str):
    def rule(values):
        if values["shared_parameters"]["enabled"] and not values["different_groups"]:
            return ("different_groups", f"is empty: name at least one group of modules to apply {section_key} to "
                                        f'(e.g. {{"g1": {{"params": {{...}}, "modules": ["*"]}}}})')
        return None

    return rule


# ---------------------------------------------------------------- weight quantization
@schema
class MixedQuantizeConfig:
    enabled: bool = field(False, doc="use a mix of the weight and its quantized value, moving to the "
                                     "quantized value over training")
    quantize_change_ratio: float = field(0.001, gt=0, le=1, doc="initial share of the quantized value; grows by "
                                                                "this much every step until 1")


@schema
class WeightQuantizationShared:
    enabled: bool = field(False, doc="quantize the selected weights")
    quantizer_kernel: bool = field(False, doc="require dsplug's native quantizer op (same results as the torch "
                                              "implementation, which is used when this is false and the op is "
                                              "not built)")
    schedule_offset: int = field(0, ge=0, doc="first step at which weights are quantized")
    quantize_groups: int = field(1, ge=1, doc="groups per weight matrix, each with its own scale")
    quantize_verbose: bool = field(False, doc="print the bit width of each group when it changes")
    quantization_type: str = field("symmetric", choices=("symmetric", "asymmetric"))
    rounding: str = field("nearest", choices=("nearest", "stochastic"))
    quantize_weight_in_forward: bool = field(
        False, doc="true: the forward uses the quantized weights (straight-through gradients; required for "
                   "fp32 training). false: the fp16/bf16 weights are replaced by their quantized values after "
                   "each optimizer step (the fp32 master copy keeps full precision)")
    fp16_mixed_quantize: MixedQuantizeConfig = field(factory=MixedQuantizeConfig)


@schema
class WeightQuantizationParams:
    start_bits: int = field(8, ge=2, le=16, doc="bit width when quantization starts")
    target_bits: int = field(8, ge=2, le=16, doc="bit width reached by lowering one bit per quantization_period")
    quantization_period: int = field(1, ge=1, doc="steps between one-bit reductions")

    __rules__ = (lambda v: ("target_bits", f"{v['target_bits']} is above start_bits {v['start_bits']}: bits only "
                                           f"go down during training") if v["target_bits"] > v["start_bits"] else None,)


@schema
class WeightQuantizationGroup:
    params: WeightQuantizationParams = field(factory=WeightQuantizationParams)
    modules: List[str] = field(factory=lambda: list(ALL_LAYERS), doc="name patterns of the layers")
    related_modules: Optional[List[List[str]]] = field(None, doc="accepted for DeepSpeed configs; weight "
                                                                 "quantization does not use it")


@schema
class WeightQuantizationConfig:
    shared_parameters: WeightQuantizationShared = field(factory=WeightQuantizationShared)
    different_groups: Dict[str, WeightQuantizationGroup] = field(factory=dict)
    __rules__ = (_group_list("weight quantization"),)


# ---------------------------------------------------------------- activation quantization
@schema
class ActivationQuantizationShared:
    enabled: bool = field(False, doc="quantize the inputs of the selected layers")
    quantization_type: str = field("symmetric", choices=("symmetric", "asymmetric"))
    range_calibration: str = field("static", choices=("dynamic", "static"),
                                   doc="dynamic: per-token min/max; static: a moving average of batch min/max")
    schedule_offset: int = field(1000, ge=0, doc="first step at which activations are quantized")


@schema
class ActivationQuantizationParams:
    bits: int = field(8, ge=2, le=16)


@schema
class ActivationQuantizationGroup:
    params: ActivationQuantizationParams = field(factory=ActivationQuantizationParams)
    modules: List[str] = field(factory=lambda: list(ALL_LAYERS))
    related_modules: Optional[List[List[str]]] = field(None, doc="accepted for DeepSpeed configs; not used")


@schema
class ActivationQuantizationConfig:
    shared_parameters: ActivationQuantizationShared = field(factory=ActivationQuantizationShared)
    different_groups: Dict[str, ActivationQuantizationGroup] = field(factory=dict)
    __rules__ = (_group_list("activation quantization"),)


# ---------------------------------------------------------------- pruning
@schema
class PruningParams:
    dense_ratio: float = field(0.5, gt=0, le=1, doc="share of the weights / rows / heads / channels kept")


@schema
class PruningGroup:
    params: PruningParams = field(factory=PruningParams)
    modules: List[str] = field(factory=lambda: list(ALL_LAYERS))
    related_modules: Optional[List[List[str]]] = field(
        None, doc="per modules entry, the layers whose input dimension follows the pruned one")


@schema
class SparsePruningShared:
    enabled: bool = field(False)
    schedule_offset: int = field(1000, ge=0, doc="first step with a mask")
    schedule_offset_end: Optional[int] = field(None, ge=0, doc="snip_momentum: step at which the final "
                                                                "sparsity is reached")
    schedule_offset_stride: Optional[int] = field(None, ge=1, doc="snip_momentum: steps between mask updates")
    method: str = field("l1", choices=("l1", "topk", "snip_momentum"))
    block_pattern: str = field("4x1", check=_block_pattern, doc="snip_momentum: 'NxM' blocks or 'N:M'")
    dense_ratio: float = field(0.1, gt=0, le=1, doc="snip_momentum: share of the weights kept at the end")
    excluded_modules: List[str] = field(factory=list, doc="snip_momentum: name patterns never pruned")

    __rules__ = (
        lambda v: [(key, "is required with method 'snip_momentum'") for key in
                   ("schedule_offset_end", "schedule_offset_stride") if v["method"] == "snip_momentum" and v[key] is None],
        lambda v: ("schedule_offset_end", f"{v['schedule_offset_end']} must be after schedule_offset "
                                          f"{v['schedule_offset']}")
        if v["method"] == "snip_momentum" and v["schedule_offset_end"] is not None
        and v["schedule_offset_end"] <= v["schedule_offset"] else None,
    )


@schema
class SparsePruningConfig:
    shared_parameters: SparsePruningShared = field(factory=SparsePruningShared)
    different_groups: Dict[str, PruningGroup] = field(factory=dict)

    __rules__ = (lambda v: _group_list("sparse pruning")(v) if v["shared_parameters"]["method"] != "snip_momentum"
                 else None,)


@schema
class RowPruningShared:
    enabled: bool = field(False)
    schedule_offset: int = field(1000, ge=0, doc="first step with a mask")
    method: str = field("l1", choices=("l1", "topk"), doc="l1: rows of largest L1 norm, taken once; "
                                                          "topk: learned scores")


@schema
class RowPruningConfig:
    shared_parameters: RowPruningShared = field(factory=RowPruningShared)
    different_groups: Dict[str, PruningGroup] = field(factory=dict)
    __rules__ = (_group_list("row pruning"),)


@schema
class HeadPruningShared:
    enabled: bool = field(False)
    schedule_offset: int = field(1000, ge=0, doc="first step with a mask")
    method: str = field("topk", choices=("topk", "l1"))
    num_heads: int = field(ge=1, doc="attention heads of the pruned output projections")


@schema
class HeadPruningConfig:
    shared_parameters: HeadPruningShared = field(factory=lambda: HeadPruningShared(num_heads=1))
    different_groups: Dict[str, PruningGroup] = field(factory=dict)
    __rules__ = (_group_list("head pruning"),)


@schema
class ChannelPruningConfig:
    shared_parameters: RowPruningShared = field(factory=RowPruningShared)
    different_groups: Dict[str, PruningGroup] = field(factory=dict)
    __rules__ = (_group_list("channel pruning"),)


# ---------------------------------------------------------------- layer reduction
@schema
class LayerReductionConfig:
    enabled: bool = field(False)
    keep_number_layer: int = field(1, ge=1, doc="layers the student keeps")
    module_name_prefix: str = field("", doc="dotted name of the ModuleList holding the layers")
    teacher_layer: List[int] = field(factory=list, ge=0, doc="teacher layer index for each student layer")
    other_module_name: List[str] = field(factory=list, doc="modules copied from the teacher as they are")

    __rules__ = (
        lambda v: ("teacher_layer", f"has {len(v['teacher_layer'])} entries for keep_number_layer "
                                    f"{v['keep_number_layer']}: give one teacher layer per kept layer")
        if v["enabled"] and len(v["teacher_layer"]) != v["keep_number_layer"] else None,
        lambda v: ("module_name_prefix", "is required (the dotted name of the model's layer list, e.g. "
                                         "'bert.encoder.layer')") if v["enabled"] and not v["module_name_prefix"]
        else None,
    )


# ---------------------------------------------------------------- cross-section rules
def in_step_quantization_needs_low_precision(config, report) -> None:
    """quantize_weight_in_forward false needs separate fp16/bf16 weights (a config rule, so that
    ``dsplug config check`` reports it too)."""
    for provided, section in config.compression:
        if provided.name != "weight_quantization":
            continue
        shared = section.shared_parameters
        if not shared.enabled or shared.quantize_weight_in_forward:
            continue
        if config.selection("precision")[0].name == "fp32":
            report.error("compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward",
                         "false quantizes the fp16/bf16 weights after each optimizer step, keeping the fp32 master "
                         "copy exact; this config trains in fp32, where the weights are the optimizer's own. Set it "
                         "to true (quantize in the forward) or enable bf16 / fp16")
