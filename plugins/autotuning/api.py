"""The names of ``dsplug.autotuning`` (DeepSpeed's ``deepspeed.autotuning``), declared by this
plugin through ``dsplug_api_modules``."""
from __future__ import annotations

from .autotuner import PROFILE_RUN, Autotuner, load_summary, run_autotuning
from .config import AutotuningConfig, ModelInfoConfig
from .space import DEFAULT_KNOB_SPACES, AutotuningError, Candidate
from .tuner import GridSearchTuner, ModelBasedTuner, RandomTuner

#: DeepSpeed's name for the parsed section
DeepSpeedAutotuningConfig = AutotuningConfig

__all__ = ["Autotuner", "AutotuningConfig", "AutotuningError", "Candidate", "DEFAULT_KNOB_SPACES",
           "DeepSpeedAutotuningConfig", "GridSearchTuner", "ModelBasedTuner", "ModelInfoConfig", "PROFILE_RUN",
           "RandomTuner", "load_summary", "run_autotuning"]
