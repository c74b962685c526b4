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
    selects:  for a section-owning spec, ``(category, field)``: the section's ``field`` names the
              plugin of ``category`` to use (``zero_optimization`` selects ``zero_stage`` by
              ``stage``). The kernel reads nothing else to choose a plugin.
    default:  the plugin of its category used when the config selects none (fp32 precision).
    priority: accelerators: among the available ones, the highest priority is picked.
    states_per_param: optimizers: fp32 values of state kept per parameter (Adam: 2), for memory
              estimates.
    traits:   what the plugin does, declared for config checks without building it: a
              ``zero_stage``'s :class:`dsplug.contracts.ZeroStageTraits`, an ``offload_device``'s
              capabilities (a frozenset, see :mod:`dsplug.contracts.offload`).
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
    selects: Optional[Tuple[str, str]] = None
    default: bool = False
    priority: int = 0
    states_per_param: Optional[int] = None
    traits: Any = None

    def names(self) -> Tuple[str, ...]:
        return (self.name,) + self.aliases


@attrs.frozen
class CliCommand:
    """A ``dsplug`` subcommand a plugin contributes (hook ``dsplug_cli_commands``).

    name:          the word after ``dsplug`` (``"zero-to-fp32"``)
    help:          one line for ``dsplug --help``
    add_arguments: ``add_arguments(parser)`` adds the command's arguments to its argparse parser
    run:           ``run(args) -> int`` the exit code; import heavy things (torch) inside it
    description:   longer text for ``dsplug NAME --help`` (default: ``help``)
    """

    name: str = attrs.field(validator=_name_ok)
    help: str
    add_arguments: Callable[[Any], None]
    run: Callable[[Any], Optional[int]]
    description: Optional[str] = None


@attrs.frozen
class ApiModule:
    """A public import path (``dsplug.zero``) whose names a plugin module provides (hook
    ``dsplug_api_modules``). The kernel keeps a thin module at ``path`` that forwards attribute
    access to ``target`` on first use, so blocking the plugin makes the path say who is missing.
    """

    path: str
    target: str


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

    @property
    def module(self) -> str:
        """The dotted module that implements it (its factory's, else its schema's)."""
        for obj in (self.spec.factory, self.spec.schema):
            obj = getattr(obj, "func", obj)  # a functools.partial: where its function lives
            if obj is not None and getattr(obj, "__module__", None):
                return obj.__module__
        return self.entry_point
