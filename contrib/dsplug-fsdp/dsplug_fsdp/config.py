"""The keys the ``fsdp2`` stage adds to ``zero_optimization`` (how the model is cut into FSDP2
units: :class:`Fsdp2Config`, the stage spec's ``schema``, so the kernel validates them only while
``fsdp2`` is selected) and the config rules that refuse what this stage does not do. Cheap to
import (no torch).

```json
"zero_optimization": {"stage": "fsdp2", "wrap": ["GPT2Block"], "reshard_after_forward": true}
```
"""
from __future__ import annotations

from typing import List

from dsplug.config.schema import field, key_map, schema

#: the name ``zero_optimization.stage`` selects this stage by
STAGE_NAME = "fsdp2"

#: keys of the ``zero_optimization`` schema this stage acts on (its own keys, :class:`Fsdp2Config`,
#: are not in that schema). Every other key of the schema a config gives is a tuning knob of dsplug's own stages that FSDP2 has no counterpart for: accepted (so a DeepSpeed
#: config keeps working when only the stage changes) with a notice saying it does nothing here.
#: The offload sections and ZeRO++ keys are refused by the ``zero_optimization`` rules from this
#: stage's traits.
HONOURED_ZERO_KEYS = frozenset({
    "stage",
    "reduce_scatter",  # false: the gradient reduction is an all-reduce (then each rank keeps its rows)
    "load_from_fp32_weights",  # bf16 / fp16: masters from the checkpoint's fp32 shards, else from the module
    "ignore_unused_parameters",  # true as in DeepSpeed: a parameter without gradient is not updated
    "stage3_gather_16bit_weights_on_model_save",  # save_16bit_model always gathers here (true or false)
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "mics_shard_size",
})


@schema
class Fsdp2Config:
    wrap: List[str] = field(factory=list, doc="class names of the submodules sharded as FSDP2 units of their own "
                                              "(gathered one at a time); empty: the entries of the model's "
                                              "outermost nn.ModuleLists (transformer blocks), else the children "
                                              "of an nn.Sequential model, else the whole model as one unit")
    reshard_after_forward: bool = field(True, doc="free each unit's gathered parameters after its forward and "
                                                  "gather them again for backward (ZeRO-3); false keeps them "
                                                  "until backward (ZeRO-2-like memory, one all-gather less)")


def _selects_fsdp2(config) -> bool:
    zero = config.sections.get("zero_optimization")
    return zero is not None and str(zero.stage).lower() == STAGE_NAME


def fsdp2_rules(config, report) -> None:
    """What a config selecting ``fsdp2`` may not combine with it. (Its own keys given with another
    stage are the kernel's error: they belong to the unselected stage ``fsdp2``.)"""
    if not _selects_fsdp2(config):
        return
    accum = config.kernel.data_types.grad_accum_dtype
    if accum is not None and accum.lower() != "fp32":
        report.error("data_types.grad_accum_dtype",
                     f"{accum!r}: the ZeRO stage {STAGE_NAME!r} accumulates gradients in the fp32 shards of its "
                     "parameters (FSDP2 keeps the sharded gradient in the parameter's dtype); give \"fp32\" or "
                     "leave it out")
    raw = config.raw.get("zero_optimization")
    owner = config.registry.sections().get("zero_optimization")
    if isinstance(raw, dict) and owner is not None and owner.spec.schema is not None:
        known = key_map(owner.spec.schema)  # (an unknown key is the schema's error already)
        for key in raw:
            if key in known and key not in HONOURED_ZERO_KEYS:
                report.notice(f"zero_optimization.{key}",
                              f"has no effect with the ZeRO stage {STAGE_NAME!r}: FSDP2 gathers and reduces one "
                              f"unit at a time (zero_optimization.wrap says which modules are units)")
