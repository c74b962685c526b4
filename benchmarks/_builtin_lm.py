"""What the benchmarks on the built-in character LM share: its ``dsplug train`` config."""
from __future__ import annotations

import json
from typing import Any, Dict


def builtin_lm_config(micro_batch: int, seed: int, steps: int) -> Dict[str, Any]:
    """The built-in ``dsplug train`` config without its monitors, filled in for a run of ``steps``."""
    from dsplug.plugins.train.job_config import auto_warmup_steps, builtin_config_text

    raw = json.loads(builtin_config_text())
    for section in ("csv_monitor", "tensorboard"):
        raw.pop(section, None)
    raw["train_micro_batch_size_per_gpu"] = micro_batch
    raw["seed"] = seed
    raw["steps_per_print"] = 10 ** 9
    params = raw["scheduler"]["params"]
    params["total_num_steps"] = steps
    params["warmup_num_steps"] = auto_warmup_steps(steps)
    return raw
