"""The whole config: kernel keys, plugin-owned sections, selected plugins, cross-section rules.

Building a :class:`DsplugConfig` parses and validates everything at once and raises a single
:class:`~dsplug.config.schema.ConfigError` listing every problem. Ownership:

* the kernel owns the keys of :class:`~dsplug.config.kernel_schema.KernelConfig`;
* ``optimizer.params`` / ``scheduler.params`` belong to the plugin ``type`` selects;
* any other top-level section belongs to the plugin whose spec declares ``section=`` for it;
* in a section whose spec ``selects=(category, field)`` (``zero_optimization`` selects the
  ``zero_stage`` by ``stage``), the keys the section's schema lacks belong to the selected plugin
  when its spec has a ``schema`` (and no section of its own): they are validated by that schema
  only while it is selected (:meth:`DsplugConfig.selected_params`);
* a section DeepSpeed documents but no installed plugin owns is an error saying so.
"""
from __future__ import annotations

import warnings
from collections import abc
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import attrs

from ..events import call_impl
from ..registry import PluginNotFoundError, get_registry, suggest
from .auto import BATCH_KEYS, auto_paths, fill_auto
from .batch import BatchError, implied_world_size, infer_batch
from .kernel_schema import COMPRESSION_SECTION, DOCUMENTED_COMPRESSION_METHODS, DOCUMENTED_SECTIONS, KernelConfig
from .loader import load_raw
from .schema import AUTO, ConfigError, Report, is_auto, key_map, parse, to_dict

KERNEL_KEYS = tuple(a.name for a in attrs.fields(KernelConfig))
#: top-level spellings DeepSpeed accepted in the past -> the modern key
LEGACY_SECTION_NAMES = {"bfloat16": "bf16"}


class DsplugDeprecationWarning(FutureWarning):
    """A legacy config form was accepted; the message shows the modern form."""


class DsplugConfigWarning(UserWarning):
    """A DeepSpeed setting that dsplug accepts has no effect here."""


@attrs.frozen
class Selected:
    """The plugin a ``type`` key selected, with its parsed ``params``."""

    provided: Any  # registry.Provided
    params: Any  # instance of the plugin's schema (or a dict when it has none)
    type: str

    @property
    def spec(self):
        return self.provided.spec

    def build(self, *args):
        return self.provided.spec.factory(*args)


class DsplugConfig(abc.Mapping):
    """A validated config.

    Also a read-only mapping over the resolved config (:meth:`to_dict`), as DeepSpeed's
    ``engine.config`` is a dict: ``config["zero_optimization"]["stage"]``,
    ``config.get("fp16", {})`` return plain JSON data (keys the user's config gives, with defaults
    filled in; an absent section is absent). ``dict(config)`` is a copy. Equality and hashing stay
    those of the object. The parsed parts are attributes: ``kernel``, ``sections``,
    ``section(name)``, ``optimizer`` ...

    ``source``: a path, dict or JSON / HJSON text.
    ``world_size``: the data-parallel size; batch sizes are inferred against it. When None, a
    fully given batch triple must imply a whole world size.
    ``auto_values`` / ``hidden_size``: passed to :func:`~dsplug.config.auto.fill_auto`.
    ``strict_auto``: every ``"auto"`` must be resolved (the engine builds with this on;
    ``dsplug config check`` leaves it off, as Hugging Face templates are full of ``"auto"``).
    """

    def __init__(
        self,
        source,
        world_size: Optional[int] = None,
        *,
        registry=None,
        auto_values: Optional[Mapping[str, Any]] = None,
        hidden_size: Optional[int] = None,
        strict_auto: bool = False,
    ):
        raw, where = load_raw(source)
        self.source = where
        self.registry = registry or get_registry()
        report = Report(where)
        raw = self._rename_legacy_sections(raw, report)
        if auto_values or hidden_size is not None:
            raw = fill_auto(raw, auto_values, hidden_size=hidden_size, registry=self.registry)
        self.raw: Dict[str, Any] = raw
        self.world_size = world_size
        self.sections: Dict[str, Any] = {}
        #: ``compression_training`` methods in config order: (provided, parsed section)
        self.compression: List[Tuple[Any, Any]] = []
        #: category -> (section, the selected plugin's parsed keys in it) (see :meth:`selected_params`)
        self._selected_params: Dict[str, Tuple[str, Any]] = {}
        self.kernel: KernelConfig = self._parse_kernel(raw, report)
        self.optimizer: Optional[Selected] = self._select("optimizer", "optimizer", report)
        self.scheduler: Optional[Selected] = self._select("scheduler", "scheduler", report)
        self._parse_sections(raw, report)
        self._resolve_batch(report, strict_auto)
        if strict_auto:
            self._refuse_unresolved_auto(report)
        self._run_rules(report)
        self.warnings = list(report.warnings) + list(report.notices)
        for issue in report.warnings:
            warnings.warn(str(issue), DsplugDeprecationWarning, stacklevel=2)
        for issue in report.notices:
            warnings.warn(str(issue), DsplugConfigWarning, stacklevel=2)
        report.raise_if_errors()

    # ------------------------------------------------------------------ parsing
    def _rename_legacy_sections(self, raw: Dict[str, Any], report: Report) -> Dict[str, Any]:
        for old, new in LEGACY_SECTION_NAMES.items():
            if old in raw:
                if new in raw:
                    report.error(old, f"given together with {new!r}; keep only {new!r}")
                    continue
                raw[new] = raw.pop(old)
                report.warn(old, f"the section name {old!r} is deprecated; write \"{new}\": {{...}} instead")
        return raw

    def _parse_kernel(self, raw: Dict[str, Any], report: Report) -> KernelConfig:
        mine = {k: v for k, v in raw.items() if k in KERNEL_KEYS}
        return parse(KernelConfig, mine, "", report)

    def _select(self, key: str, category: str, report: Report) -> Optional[Selected]:
        chosen = getattr(self.kernel, key)
        if chosen is None or key not in self.raw or not isinstance(self.raw.get(key), dict):
            return None
        try:
            provided = self.registry.get(category, chosen.type, what=f"{key}.type")
        except PluginNotFoundError as exc:
            report.error(f"{key}.type", str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc))
            return None
        schema_cls = provided.spec.schema
        if schema_cls is None:  # "takes no config": selectable with no params
            if not _takes_no_config(f"{key}.params", chosen.params, provided, report):
                return None
            return Selected(provided=provided, params={}, type=chosen.type)
        params = parse(schema_cls, chosen.params, f"{key}.params", report)
        return Selected(provided=provided, params=params, type=chosen.type)

    def _parse_sections(self, raw: Dict[str, Any], report: Report) -> None:
        owners = self.registry.sections()
        for key, value in raw.items():
            if key in KERNEL_KEYS:
                continue
            if key == COMPRESSION_SECTION:
                self._parse_compression(value, report)
                continue
            owner = owners.get(key)
            conflict = self.registry.conflicts.get(("section", key))
            if conflict is not None:
                report.error(key, conflict)
            elif owner is not None:
                if owner.spec.schema is None:  # "takes no config": the section is present and empty
                    if _takes_no_config(key, value, owner, report):
                        self.sections[key] = {}
                    continue
                value = self._split_selected_keys(owner, key, value, report)
                self.sections[key] = parse(owner.spec.schema, value, key, report)
            elif key in DOCUMENTED_SECTIONS:
                report.error(
                    key,
                    f"this is DeepSpeed's {DOCUMENTED_SECTIONS[key]} section, but no installed dsplug plugin "
                    f"provides it (yet). Remove the section, or install a plugin that owns {key!r} "
                    f"(`dsplug list` shows what is installed)",
                )
            else:
                known = list(KERNEL_KEYS) + list(owners) + list(DOCUMENTED_SECTIONS)
                guess = suggest(key, known)
                hint = f"; did you mean {guess!r}?" if guess else ""
                report.error(key, f"unknown top-level key{hint} (`dsplug config explain` lists the valid keys)")

    def _selected_by(self, owner, value: Dict[str, Any]):
        """The plugin ``value`` (a section selecting ``owner.spec.selects``) names, or None."""
        category, field_name = owner.spec.selects
        attribute = key_map(owner.spec.schema).get(field_name)
        name = next((v for k, v in value.items() if key_map(owner.spec.schema).get(k) is attribute), None) \
            if attribute is not None else None
        if name is None and attribute is not None and attribute.default is not attrs.NOTHING:
            name = attribute.default
        if name is None or is_auto(name) or isinstance(name, (dict, list, bool)):
            return None
        return self.registry.find(category, str(name))

    def _split_selected_keys(self, owner, key: str, value, report: Report):
        """For a section that selects a plugin: the keys of ``value`` its own schema parses; the
        keys the selected plugin's ``schema`` declares are parsed by it (kept for
        :meth:`selected_params`). A key of another, unselected plugin of the category is an error
        naming that plugin; any other unknown key gets did-you-mean over both schemas."""
        if not owner.spec.selects or not isinstance(value, dict):
            return value
        category, field_name = owner.spec.selects
        own = key_map(owner.spec.schema)
        selected = self._selected_by(owner, value)
        plugin_schema = selected.spec.schema if selected is not None and not selected.spec.section else None
        theirs = key_map(plugin_schema) if plugin_schema is not None else {}
        mine, plugin_values = {}, {}
        for k, v in value.items():
            if k in own:
                mine[k] = v
            elif k in theirs:
                plugin_values[k] = v
            else:
                others = [p.name for p in self.registry.all() if p.category == category and p is not selected
                          and p.spec.schema is not None and not p.spec.section and k in key_map(p.spec.schema)]
                if others:
                    chosen = selected.name if selected is not None else value.get(field_name)
                    report.error(f"{key}.{k}", f"is a key of the {category} {others[0]!r}, which this config does not "
                                               f"select ({key}.{field_name} selects {chosen!r}); remove it or select "
                                               f"{others[0]!r}")
                elif plugin_schema is not None:
                    guess = suggest(k, list(own) + list(theirs))
                    if guess:
                        report.error(f"{key}.{k}", f"unknown key; did you mean {key + '.' + guess!r}?")
                    else:
                        valid = ", ".join(sorted({a.name for a in own.values()} | {a.name for a in theirs.values()}))
                        report.error(f"{key}.{k}", f"unknown key. Valid keys here (with the {category} "
                                                   f"{selected.name!r}): {valid}")
                else:
                    mine[k] = v  # the section's schema reports it
        if plugin_schema is not None:
            self._selected_params[category] = (key, parse(plugin_schema, plugin_values, key, report))
        return mine

    def selected_params(self, category: str):
        """The selected plugin's own keys in the section that selects it: an instance of its
        spec's ``schema`` (defaults for keys the config leaves out), or None when the selected
        plugin declares no schema (or none is selected by a section). A ZeRO stage reads
        ``context.config.selected_params("zero_stage")`` for the keys it added to
        ``zero_optimization``."""
        if category in self._selected_params:
            return self._selected_params[category][1]
        for owner in self.registry.sections().values():
            if owner.spec.selects and owner.spec.selects[0] == category:
                try:
                    provided, _ = self.selection(category)
                except PluginNotFoundError:
                    return None
                if provided.spec.schema is None or provided.spec.section:
                    return None
                return parse(provided.spec.schema, {}, owner.spec.section)
        return None

    def _parse_compression(self, value, report: Report) -> None:
        """Each key under ``compression_training`` selects the compression plugin of that name."""
        if not isinstance(value, Mapping):
            report.error(COMPRESSION_SECTION, f"must be an object mapping compression methods to their settings, "
                         f"got {type(value).__name__}")
            return
        for key, body in value.items():
            path = f"{COMPRESSION_SECTION}.{key}"
            provided = self.registry.find("compression", key)
            if provided is None:
                if key in DOCUMENTED_COMPRESSION_METHODS:
                    report.error(path, f"this is DeepSpeed's {DOCUMENTED_COMPRESSION_METHODS[key]} method, but no "
                                 "installed dsplug plugin provides it (yet) (`dsplug list --category compression`)")
                else:
                    known = self.registry.names("compression") + list(DOCUMENTED_COMPRESSION_METHODS)
                    guess = suggest(key, known)
                    report.error(path, "unknown compression method" + (f"; did you mean {guess!r}?" if guess else "")
                                 + f" (installed: {', '.join(self.registry.names('compression')) or 'none'})")
                continue
            if provided.spec.schema is None:
                if _takes_no_config(path, body, provided, report):
                    self.compression.append((provided, {}))
                continue
            self.compression.append((provided, parse(provided.spec.schema, body, path, report)))

    def _resolve_batch(self, report: Report, strict_auto: bool) -> None:
        k = self.kernel
        given = {name: getattr(k, name) for name in BATCH_KEYS}
        errors_before = len(report.errors)
        decided = self._plugin_batch_sizes(report)
        if decided is not None:  # a plugin owns the batch sizes (elastic training): its values replace the keys
            if len(report.errors) > errors_before or (not decided and report.errors):
                return  # the owner's section is invalid (reported): no second, derived error
            given = {name: decided.get(name) for name in BATCH_KEYS}
        autos = [name for name, v in given.items() if is_auto(v)]
        values = {name: (None if is_auto(v) else v) for name, v in given.items()}
        if self.world_size is None:
            if all(v is not None for v in values.values()):
                w = implied_world_size(*values.values())
                if w is None:
                    report.error(
                        "train_batch_size",
                        f"{values['train_batch_size']} is not a multiple of train_micro_batch_size_per_gpu × "
                        f"gradient_accumulation_steps = {values['train_micro_batch_size_per_gpu']} × "
                        f"{values['gradient_accumulation_steps']}, so no world size fits",
                    )
            elif not any(v is not None for v in values.values()) and not autos and not strict_auto and decided is None:
                report.error("train_batch_size", "set train_batch_size or train_micro_batch_size_per_gpu")
            return
        try:
            tb, mb, gas = infer_batch(*values.values(), self.world_size)
        except BatchError as exc:
            if autos and not strict_auto:
                return
            path = "train_batch_size"
            report.error(path, str(exc) + (f' ("auto" values: {", ".join(autos)})' if autos else ""))
            return
        self.kernel = attrs.evolve(
            self.kernel, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas
        )

    def _plugin_batch_sizes(self, report: Report) -> Optional[Dict[str, Any]]:
        """What the one plugin answering ``dsplug_batch_sizes`` decided, or None (see the hookspec)."""
        decided, owner = None, None
        hook = self.registry.pm.hook.dsplug_batch_sizes
        arguments = {"config": self, "world_size": self.world_size, "report": report}
        for impl in reversed(hook.get_hookimpls()):
            try:
                answer = call_impl(impl, arguments)
            except ConfigError:
                raise
            except Exception as exc:  # a buggy plugin must be visible, not fatal to the message
                report.error("train_batch_size", f"plugin {impl.plugin_name!r} failed in dsplug_batch_sizes: "
                             f"{type(exc).__name__}: {exc}")
                return {}
            if answer is None:
                continue
            unknown = sorted(set(answer) - set(BATCH_KEYS))
            if owner is not None or unknown:
                why = (f"plugins {owner!r} and {impl.plugin_name!r} both set the batch sizes" if owner is not None else
                       f"plugin {impl.plugin_name!r} returned {unknown}, which are not batch keys")
                report.error("train_batch_size", f"{why} (dsplug_batch_sizes)")
                return {}
            decided, owner = dict(answer), impl.plugin_name
        return decided

    def _refuse_unresolved_auto(self, report: Report) -> None:
        resolved = to_dict_of(self)
        for path, _ in auto_paths(resolved):
            report.error(
                path,
                '"auto" is not resolved: nothing in this run provides it. Give a value, or fill it with '
                f'dsplug.config.fill_auto(config, {{"{path}": ...}}) before initialize',
            )

    def _run_rules(self, report: Report) -> None:
        from .rules import KERNEL_RULES

        rules = list(KERNEL_RULES)
        for provided in self.registry.all():
            rules.extend(provided.spec.rules)
        for rule in rules:
            try:
                rule(self, report)
            except Exception as exc:  # a buggy plugin rule must be visible, not fatal
                report.error("", f"config rule {getattr(rule, '__qualname__', rule)} failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ access
    def __getattr__(self, name):
        # only called when normal lookup fails: expose the kernel's keys as attributes
        kernel = self.__dict__.get("kernel")
        if kernel is not None and name in KERNEL_KEYS:
            return getattr(kernel, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def has_section(self, name: str) -> bool:
        return name in self.sections

    def section(self, name: str):
        """The parsed section, or its schema's defaults when absent (None if no plugin owns it)."""
        if name in self.sections:
            return self.sections[name]
        owner = self.registry.sections().get(name)
        if owner is None or owner.spec.schema is None:
            return None
        return parse(owner.spec.schema, {}, name)

    def selection(self, category: str) -> Tuple[Any, Any]:
        """``(provided, section)``: the plugin of ``category`` this config selects, and the parsed
        section it was selected by (or that it owns), for categories the config selects once
        (precision, zero_stage).

        The choice is read from the specs alone: a section whose spec ``selects`` this category
        names it by one of its fields; else the plugin of the category whose own section says
        ``enabled: true``; else the category's ``default`` plugin.
        """
        for owner in self.registry.sections().values():
            if owner.spec.selects and owner.spec.selects[0] == category:
                field_name = owner.spec.selects[1]
                section = self.section(owner.spec.section)
                name = getattr(section, field_name)
                return self.registry.get(category, str(name), what=f"{owner.spec.section}.{field_name}"), section
        specs = [p for p in self.registry.all() if p.category == category]
        for provided in specs:
            section = self.sections.get(provided.spec.section) if provided.spec.section else None
            if getattr(section, "enabled", False) is True:
                return provided, section
        for provided in specs:
            if provided.spec.default:
                return provided, self.section(provided.spec.section) if provided.spec.section else None
        raise PluginNotFoundError(f"no {category} plugin is selected by this config and none is installed as the "
                                  f"default (`dsplug list --category {category}`)", category, "", [])

    # ------------------------------------------------------------------ the resolved dict (Mapping)
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def _resolved(self) -> Dict[str, Any]:
        return to_dict_of(self)

    def __getitem__(self, key: str):
        return self._resolved()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def __contains__(self, key) -> bool:
        return key in self._resolved()

    def get(self, name: str, default=None):
        """``name``'s value in the resolved config (plain data), else ``default``."""
        return self._resolved().get(name, default)

    def to_dict(self) -> Dict[str, Any]:
        return to_dict_of(self)

    def __repr__(self) -> str:
        return f"DsplugConfig(source={self.source!r}, world_size={self.world_size})"


def _takes_no_config(path: str, value, provided, report: Report) -> bool:
    """A plugin whose spec has ``schema=None`` takes no config: ``value`` must be empty (``{}`` or
    null). Reports an error naming the keys given otherwise."""
    if value is None or (isinstance(value, Mapping) and not value):
        return True
    given = ", ".join(map(repr, value)) if isinstance(value, Mapping) else repr(value)
    report.error(path, f"plugin {provided.category}:{provided.name} (distribution {provided.distribution!r}) takes no "
                 f"config (its PluginSpec has schema=None), but {given} was given; remove it or leave it empty")
    return False


def to_dict_of(config: DsplugConfig) -> Dict[str, Any]:
    """The resolved config as JSON-ready data (defaults filled in)."""
    out = {k: v for k, v in to_dict(config.kernel).items() if k in config.raw or k in BATCH_KEYS}
    for key in ("optimizer", "scheduler"):
        selected = getattr(config, key)
        if selected is not None:
            params = to_dict(selected.params) if attrs.has(type(selected.params)) else dict(selected.params)
            out[key] = {"type": selected.type, "params": params}
    for name, section in config.sections.items():
        out[name] = to_dict(section) if attrs.has(type(section)) else dict(section)
    for name, params in config._selected_params.values():  # a selected plugin's keys in its section
        if name in out:
            out[name].update(to_dict(params))
    if config.compression:
        out[COMPRESSION_SECTION] = {p.name: to_dict(section) if attrs.has(type(section)) else dict(section)
                                    for p, section in config.compression}
    return out


def check_config(source, world_size: Optional[int] = None, registry=None) -> Optional[ConfigError]:
    """The ConfigError a config would raise, or None when it is valid."""
    try:
        DsplugConfig(source, world_size=world_size, registry=registry)
    except ConfigError as exc:
        return exc
    return None


__all__ = ["AUTO", "DsplugConfig", "DsplugConfigWarning", "DsplugDeprecationWarning", "Selected", "check_config"]
