"""What a plugin tells the kernel about itself.

A plugin module returns :class:`PluginSpec` objects from one of the category hooks in
:mod:`dsplug.hookspecs`. The kernel never imports a plugin by name: it asks the registry for the
spec whose ``name`` matches the config's value and calls its ``factory``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import attrs

#: The plugin categories. The config value that selects a plugin is looked up in one of these.
CATEGORIES: Tuple[str, ...] = (
    "accelerator",
    "optimizer",
    "scheduler",
    "precision",
    "zero_stage",
    "offload_device",
    "monitor",
    "compression",
    "observer",
    "section",
)

#: One-line meaning of each category, shown by ``dsplug list``.
CATEGORY_SUMMARIES = {
    "accelerator": "device backend (selected automatically or by DSPLUG_ACCELERATOR)",
    "optimizer": "selected by optimizer.type",
    "scheduler": "selected by scheduler.type",
    "precision": "selected by the fp16 / bf16 / amp sections (fp32 otherwise)",
    "zero_stage": "selected by zero_optimization.stage",
    "offload_device": "selected by zero_optimization.offload_*.device",
    "monitor": "enabled by its own config section",
    "compression": "enabled under compression_training",
    "observer": "training observers (profilers, loggers) enabled by their section",
    "section": "owns a config section without being a selectable feature",
}


def _name_ok(_instance, attribute, value):
    if not isinstance(value, str) or not value or value != value.strip():
        raise ValueError(f"plugin {attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen
class PluginSpec:
    """A feature a plugin provides.

    category: one of :data:`CATEGORIES`.
    name:     the value that selects it in the config (``"adamw"``, ``"WarmupLR"``, ``"2"``,
              ``"cpu"``) or, for section-owning plugins, the section name. Matching is
              case-insensitive, like DeepSpeed's ``optimizer.type``.
    factory:  builds the feature; its signature is the category's contract (see hookspecs).
    schema:   an attrs class validating this plugin's config (the section it owns, or the
              ``params`` dict of an optimizer / scheduler). ``None``: it takes no config.
    section:  the top-level config section this plugin owns, if any (``"fp16"``,
              ``"tensorboard"``). A section may be owned by exactly one plugin.
    aliases:  other accepted spellings of ``name``.
    ops:      names of native ops (``csrc/``) it uses, for ``dsplug list`` build status.
    summary:  one line for ``dsplug list``.
    rules:    cross-section config rules: callables ``rule(config, report)`` run after every
              section parsed (see :mod:`dsplug.config.rules`).
    extra:    category-specific metadata (e.g. an accelerator's priority).
    """

    category: str = attrs.field(validator=attrs.validators.in_(CATEGORIES))
    name: str = attrs.field(validator=_name_ok)
    factory: Optional[Callable[..., Any]] = None
    schema: Optional[type] = None
    section: Optional[str] = None
    aliases: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    ops: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    summary: str = ""
    rules: Tuple[Callable[..., Any], ...] = attrs.field(default=(), converter=tuple)
    extra: Any = attrs.field(factory=dict)

    def names(self) -> Tuple[str, ...]:
        return (self.name,) + self.aliases


@attrs.frozen
class Provided:
    """A :class:`PluginSpec` together with where it came from (filled in by the registry)."""

    spec: PluginSpec
    distribution: str
    version: str
    entry_point: str

    @property
    def category(self) -> str:
        return self.spec.category

    @property
    def name(self) -> str:
        return self.spec.name
