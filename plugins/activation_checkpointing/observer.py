"""The engine side: configure ``dsplug.checkpointing`` from the config section, report ``profile``."""
from __future__ import annotations

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

from . import checkpointing

#: monitor tags of the per-step profile (milliseconds summed over the step's checkpointed calls)
PROFILE_TAGS = {
    "forward_ms": "Train/Samples/activation_checkpoint_forward_ms",
    "recompute_ms": "Train/Samples/activation_checkpoint_recompute_ms",
    "backward_ms": "Train/Samples/activation_checkpoint_backward_ms",
}
#: forward + recompute + backward
TOTAL_TAG = "Train/Samples/activation_checkpoint_ms"


class ActivationCheckpointingObserver(Observer):
    """On the bus of an engine whose config has ``activation_checkpointing``.

    * ``dsplug_engine_built``: :func:`~.checkpointing.configure` from the section, as DeepSpeed
      scripts do with ``configure(mpu, deepspeed_config=...)`` (an mpu given to an earlier
      ``configure`` stays; call ``configure`` after ``initialize`` to override a setting);
    * ``dsplug_forward_begin``: a new forward pass, so the contiguous buffers' row index restarts;
    * ``dsplug_step_end`` (first, so monitors see it): with ``profile`` on, the step's timings as
      metrics named by their monitor tags (``Train/Samples/activation_checkpoint_ms`` and the
      ``_forward_ms`` / ``_recompute_ms`` / ``_backward_ms`` parts), and a per-function line in the
      log every ``steps_per_print`` steps (rank 0).
    """

    name = "activation_checkpointing"

    def __init__(self, section, context):
        self.section = section
        self.rank = context.rank
        self.last_profile = {}

    @hookimpl
    def dsplug_engine_built(self, engine):
        checkpointing._configure_from_section(self.section)

    @hookimpl
    def dsplug_forward_begin(self, engine):
        checkpointing._new_forward_pass()

    @hookimpl(tryfirst=True)
    def dsplug_step_end(self, engine, metrics):
        if not checkpointing.settings().profile:
            return
        rows = checkpointing.collect_profile()
        self.last_profile = rows
        total = 0.0
        for phase, tag in PROFILE_TAGS.items():
            value = sum(row[phase] for row in rows.values())
            metrics[tag] = value
            total += value
        metrics[TOTAL_TAG] = total
        if self.rank == 0 and engine.global_steps % engine.config.steps_per_print == 0:
            from dsplug.logging import log_rank0

            log_rank0(f"[dsplug] step={engine.global_steps} {checkpointing.format_profile(rows)}")
