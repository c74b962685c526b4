"""The DeepSpeed-format config of a ``dsplug train`` run.

The config file is an ordinary dsplug / DeepSpeed config; without one the built-in
``default_config.json`` is used (AdamW, WarmupCosineLR, gradient clipping, CSV and
TensorBoard monitors). Before it is validated, the job fills in what only the run knows:

* ``scheduler.params.total_num_steps`` / ``warmup_num_steps`` given as ``"auto"``: the run's
  ``--steps``, and :func:`auto_warmup_steps` of it.
* ``seed``: ``--seed`` when given.
* every section with an ``output_path`` key in its schema (the csv_monitor and tensorboard
  monitors): an empty or relative ``output_path`` is taken inside ``--output-dir`` (DeepSpeed
  resolves it against the working directory; for this job the output directory is the place).
  Absolute paths are kept.
* the built-in config only: its tensorboard section is dropped, with a note, when the
  ``tensorboard`` package is not installed (a config you give is never changed that way).
"""
from __future__ import annotations

import importlib.util
import os
from importlib import resources
from typing import Any, Dict, List, Optional, Tuple

DEFAULT_CONFIG_NAME = "default_config.json"


def builtin_config_text() -> str:
    return resources.files("dsplug.plugins.train").joinpath(DEFAULT_CONFIG_NAME).read_text(encoding="utf-8")


def auto_warmup_steps(steps: int) -> int:
    """Warm-up length filled in for ``"auto"``: a tenth of the run, at least 2, at most the run."""
    return min(steps, max(2, round(steps / 10)))


def _sections_with_output_path(registry) -> List[str]:
    import attrs

    names = []
    for section, provided in registry.sections().items():
        schema = provided.spec.schema
        if schema is not None and attrs.has(schema) and "output_path" in attrs.fields_dict(schema):
            names.append(section)
    return names


def prepare_config(path: Optional[str], *, steps: int, output_dir: str, seed: Optional[int],
                   registry=None) -> Tuple[Dict[str, Any], str, List[str]]:
    """``(raw config dict, where it came from, notes for the user)``; nothing is validated yet.

    Raises :class:`dsplug.config.ConfigError` (naming the file) when the file is not a JSON
    object, ``FileNotFoundError`` / ``OSError`` when it cannot be read.
    """
    from dsplug.config.auto import fill_auto
    from dsplug.config.loader import load_raw
    from dsplug.registry import get_registry

    registry = registry or get_registry()
    notes: List[str] = []
    if path is None:
        raw, _ = load_raw(builtin_config_text())
        where = f"built-in {DEFAULT_CONFIG_NAME}"
    else:
        raw, where = load_raw(os.fspath(path))
    raw = fill_auto(raw, {"scheduler.params.total_num_steps": steps,
                          "scheduler.params.warmup_num_steps": auto_warmup_steps(steps)})
    if seed is not None:
        raw["seed"] = seed
    for section in _sections_with_output_path(registry):
        value = raw.get(section)
        if not isinstance(value, dict):
            continue  # a malformed section: validation reports it
        given = value.get("output_path")
        if given is None or given == "":
            value["output_path"] = output_dir
        elif isinstance(given, str) and not os.path.isabs(os.path.expanduser(given)):
            value["output_path"] = os.path.join(output_dir, given)
    if path is None and isinstance(raw.get("tensorboard"), dict) and importlib.util.find_spec("tensorboard") is None:
        del raw["tensorboard"]
        notes.append("the tensorboard package is not installed: TensorBoard logging is off "
                     "(pip install dsplug[tensorboard] to turn it on)")
    return raw, where, notes


def format_config_error(error, where: str) -> str:
    """The listing ``dsplug config check`` prints: every issue with its JSON path."""
    issues = getattr(error, "issues", None)
    if issues is None:
        return f"{where}: {error}"
    lines = [f"{where}: {len(issues)} error{'s' if len(issues) != 1 else ''}"]
    lines += [f"  - {issue}" for issue in issues]
    return "\n".join(lines)
