"""The ``flops_profiler`` config section (DeepSpeed's keys and defaults)."""
from __future__ import annotations

from typing import Optional

from dsplug.config.schema import field, schema


def _non_empty_path(value) -> Optional[str]:
    if value is not None and not value.strip():
        return "must be a file path, or null to print to stdout"
    return None


@schema
class FlopsProfilerConfig:
    enabled: bool = field(False, doc="profile one training step and print the profile")
    recompute_fwd_factor: float = field(
        0.0, ge=0.0, le=1.0,
        doc="share of the forward pass recomputed in backward by activation checkpointing "
            "(0.0 none, 1.0 all); used in the backward FLOPS estimate")
    profile_step: int = field(1, ge=1, doc="the training step to profile (1 = the first optimizer step)")
    module_depth: int = field(-1, ge=-1, doc="deepest model depth shown in the aggregated profile (-1 = all)")
    top_modules: int = field(1, ge=1, doc="modules listed per depth in the aggregated profile")
    detailed: bool = field(True, doc="also print the per-module profile tree")
    output_file: Optional[str] = field(None, check=_non_empty_path,
                                       doc="write the profile to this file instead of stdout (rank 0)")
