"""The ``activation_checkpointing`` config section: DeepSpeed's keys and defaults.

Cheap to import (no torch): ``dsplug list`` and ``dsplug config check`` read it.
"""
from __future__ import annotations

from typing import Optional

from dsplug.config.schema import field, schema


def _contiguous_needs(values):
    """DeepSpeed's ``configure`` asserts these; here ``config check`` says so first."""
    if not values["contiguous_memory_optimization"]:
        return None
    problems = []
    if not values["partition_activations"]:
        problems.append(("contiguous_memory_optimization",
                         "needs partition_activations: true (the contiguous buffers hold the partitioned "
                         "activations, as in DeepSpeed; with no model parallelism a partition is the whole tensor)"))
    if values["number_checkpoints"] is None:
        problems.append(("number_checkpoints",
                         "must be given with contiguous_memory_optimization: the number of checkpoint() calls "
                         "per forward pass, one contiguous buffer row each"))
    return problems or None


@schema
class ActivationCheckpointingConfig:
    partition_activations: bool = field(
        False, doc="keep only this model-parallel rank's slice of each checkpointed input; all-gather it "
                   "before the recompute (needs the mpu given to dsplug.checkpointing.configure)")
    cpu_checkpointing: bool = field(False, doc="keep the checkpointed inputs in host memory until the recompute")
    contiguous_memory_optimization: bool = field(
        False, doc="copy the partitioned checkpoints into preallocated contiguous buffers (one row per "
                   "checkpoint index) that are reused every step; needs partition_activations and "
                   "number_checkpoints")
    number_checkpoints: Optional[int] = field(
        None, ge=1, doc="checkpoint() calls per forward pass: the rows of the contiguous buffers")
    synchronize_checkpoint_boundary: bool = field(
        False, doc="synchronize the accelerator at the start and end of every checkpoint forward and backward")
    profile: bool = field(
        False, doc="time each checkpointed function's forward, recompute and backward; reported per step to "
                   "the monitors (Train/Samples/activation_checkpoint_*_ms) and printed every steps_per_print")

    __rules__ = (_contiguous_needs,)
