"""What a plugin tells the kernel about itself.

A plugin module returns :class:`PluginSpec` objects from one of the category hooks in
:mod:`dsplug.hookspecs`. The kernel never imports a plugin by name: it asks the registry for the
spec whose ``name`` matches the config's value and calls its ``factory``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

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
              ``params`` dict of an optimizer / scheduler, or -- for a plugin selected by a
              section's field, such as a ``zero_stage`` -- the keys it adds to that section,
              validated only while it is selected and read with
              ``config.selected_params(category)``). ``None``: it takes no config.
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
    deepspeed_config: ``deepspeed_config(config) -> {attribute: value}``: the attributes of
              DeepSpeed's ``DeepSpeedConfig`` this plugin answers (``pld_enabled``,
              ``pld_params``), from the :class:`dsplug.DsplugConfig` ``config`` -- whether or
              not the config has the plugin's section, so give DeepSpeed's values for an absent
              one too. ``dsplug.runtime.config.DeepSpeedConfig`` sets them; the kernel answers
              only its own keys.
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
    deepspeed_config: Optional[Callable[[Any], Dict[str, Any]]] = None
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


def _api_path_ok(_instance, attribute, value):
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) < 2 or parts[0] != "dsplug" or parts[1] in ("plugins", "csrc") or not all(p.isidentifier() for p in parts):
        raise ValueError(f"ApiModule.path must be a dotted import path below dsplug (not dsplug.plugins or "
                         f"dsplug.csrc), such as 'dsplug.ops.lion'; got {value!r}")


def _module_name_ok(_instance, attribute, value):
    if not isinstance(value, str) or not value or not all(p.isidentifier() for p in value.split(".")):
        raise ValueError(f"ApiModule.{attribute.name} must be a dotted module name, got {value!r}")


@attrs.frozen
class ApiModule:
    """A DeepSpeed import path (``dsplug.zero``; ``deepspeed.zero`` with the alias) whose names a
    plugin module provides (hook ``dsplug_api_modules``).

    path:   the import path, below ``dsplug``. Its parents become packages (``dsplug.runtime.pipe``
            for ``dsplug.runtime.pipe.engine``); no kernel file is needed at any of them.
    target: the plugin's module whose names are served at ``path``; imported when ``path`` is.

    Served by the import finder of :mod:`dsplug.api_paths`: ``import dsplug.zero`` gives a module
    named ``dsplug.zero`` whose attributes are the target's (the same objects); a blocked plugin's
    paths do not resolve and the ImportError names the blocked plugins. Where the kernel has a
    module at ``path`` (``dsplug.ops.adam``) its own names win and the target adds the others.
    Several plugins may declare one path: a name comes from the first that has it (dsplug's own
    plugins first).
    """

    path: str = attrs.field(validator=_api_path_ok)
    target: str = attrs.field(validator=_module_name_ok)


@attrs.frozen
class Reduction:
    """Where the gradient of a parameter is averaged: a ``dsplug_param_reduction`` answer, read by
    the ZeRO stages and the engine through :meth:`dsplug.context.BuildContext.reduction_of`.

    The default (no plugin answers) is ``Reduction(None, context.comm, context.world_size)``:
    every data-parallel rank holds the same value, the gradient is summed over the data-parallel
    group and divided by its size.

    key:        a name for the group (``"ep_size_2"``); parameters with the same key are reduced
                together (a stage keeps them in buckets / partitions of their own). None only for
                the default.
    comm:       the comm layer bound to the ranks that hold the same value of the parameter (its
                replicas): a :class:`dsplug.comm.bound.GroupComm`, or ``context.comm``. The
                gradient is summed over these ranks (partitioned over them at ZeRO stages 1-2)
                and the initial value broadcast from its first rank.
    divisor:    what the sum is divided by (to average over all data-parallel ranks' samples this
                is the data-parallel world size, also when ``comm`` is smaller). Under
                ``gradient_allreduce_op: "sum"`` ``context.reduction_of`` answers 1 instead.
    shard_comm: the ranks that hold *different* values of parameters with this key (together they
                hold each once), a ``GroupComm``; a quantity summed over the model's parameters
                (the gradient norm) adds their contributions over these ranks. None: the values
                are the same on every data-parallel rank.
    what:       these parameters in an error message (``"MoE expert parameters"``).
    advice:     how to keep them in optimizer param groups of their own, for the error a stage
                raises when one group mixes them with others ("" when there is nothing to say).
    """

    key: Optional[str]
    comm: Any
    divisor: int
    shard_comm: Any = None
    what: str = "parameters"
    advice: str = ""

    @property
    def placement(self) -> Optional[Tuple[int, Tuple[int, ...]]]:
        """``(rank in shard_comm, the global ranks of shard_comm)``: which of the different values
        this rank holds, for checkpoints to tell a layout apart (None without ``shard_comm``)."""
        if self.shard_comm is None:
            return None
        return self.shard_comm.get_rank(), tuple(getattr(self.shard_comm, "ranks", ()))


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
