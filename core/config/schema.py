"""Strict schemas for config sections: attrs classes whose fields say type, range and doc.

A plugin declares the section (or ``params`` dict) it owns like this::

    from dsplug.config.schema import schema, field

    @schema
    class Fp16Config:
        enabled: bool = field(False, auto=True, doc="train in fp16")
        loss_scale: float = field(0.0, ge=0, doc="0 = dynamic loss scaling")
        initial_scale_power: int = field(16, ge=0, le=64)

and :func:`parse` turns a JSON dict into an instance, collecting *every* problem in a
:class:`Report` rather than stopping at the first (relations between fields go in a
``__rules__`` tuple on the class; ``__legacy__`` may rewrite old forms before parsing):

* a key that is not a field (or a field alias) -> error naming its JSON path and the closest key;
* a value of the wrong type -> error naming key, value and the expected type;
* a value out of range / not among ``choices`` -> error naming what is valid;
* ``"auto"`` is accepted only by fields declared ``auto=True`` and stays ``"auto"`` until the
  engine resolves it (:mod:`dsplug.config.auto`).

JSON numbers: an ``int`` field takes ``5e8`` (an integral float) as 500000000, like DeepSpeed.
Every number must be usable (a config that trains to NaN is an error, not a run):

* a float is finite: ``NaN``, ``Infinity``, ``-Infinity`` (and JSON numbers beyond ±1.8e308,
  which read as Infinity) are errors naming the key, in every field of every schema, inside
  lists and free-form (``Any``) values too. A field opts out with ``finite=False`` (it then
  checks the value itself, or a later schema does), or accepts ``Infinity`` meaning something
  explicit with ``infinity=<stored value>`` (``steps_per_print``: never print);
* an integer fits in 64 bits (``-2**63 .. 2**63 - 1``): ``1e308`` is not an integer here;
* ``ge`` / ``gt`` / ``le`` / ``lt`` bounds apply to each number of a list value as well.

``Dict[str, SomeSchema]`` fields parse every value with ``SomeSchema`` (errors name
``section.key.<name>.field``): named groups such as ``compression_training``'s ``different_groups``.

Bounds shared by plugins (use them in ``le=`` / ``ge=``): :data:`MAX_LR` for learning rates and
:data:`MIN_LOSS_SCALE` .. :data:`MAX_LOSS_SCALE` for loss scales.
"""
from __future__ import annotations

import math
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import attrs

from ..registry import suggest

AUTO = "auto"
_NOTHING = object()

#: Largest learning rate accepted (``le=MAX_LR`` on lr fields; a kernel rule applies it to every
#: ``lr`` / ``*_lr`` key of ``optimizer.params`` and ``scheduler.params`` whatever plugin owns
#: them). Real schedules stay below ~10 (LARS-style SGD at huge batch sizes); 1e6 leaves room
#: for any experiment while ``lr * grad`` stays far from fp32's 3.4e38 overflow.
MAX_LR = 1e6
#: Loss scales must be representable in fp32 and so must their inverse (the unscale factor):
#: 2**127 is the largest power of two below fp32's max (2**128 reads as inf), 2**-126 the
#: smallest normal fp32 number. Outside this range the scaled loss or the unscaled gradients
#: become inf / 0 and then NaN.
MAX_LOSS_SCALE = 2.0 ** 127
MIN_LOSS_SCALE = 2.0 ** -126
#: Integer fields hold 64-bit integers (what torch tensors, C++ ops and checkpoints can store).
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1

_NOT_FINITE = "must be a finite number, not NaN or ±Infinity (a JSON number beyond ±1.8e308 reads as Infinity)"
_INT_RANGE = "out of range: must be a 64-bit integer (-2**63 .. 2**63 - 1)"
_FLOAT_RANGE = "out of range: too large for a floating-point number (beyond ±1.8e308)"


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


@attrs.frozen
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class Report:
    """Collects config errors and warnings so that every one can be shown at once."""

    def __init__(self, source: str = ""):
        self.source = source
        self.errors: List[Issue] = []
        self.warnings: List[Issue] = []  # deprecated forms that were rewritten
        self.notices: List[Issue] = []  # accepted settings that do nothing here

    def error(self, path: str, message: str) -> None:
        self.errors.append(Issue(path, message))

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(Issue(path, message))

    def notice(self, path: str, message: str) -> None:
        self.notices.append(Issue(path, message))

    def __bool__(self) -> bool:  # truthy when there are errors
        return bool(self.errors)

    def raise_if_errors(self) -> None:
        if self.errors:
            raise ConfigError(self.errors, self.source)


class ConfigError(ValueError):
    """Every problem found in a config. ``.issues`` lists them; ``str()`` shows them all.

    ``issues``: :class:`Issue` objects, one Issue, or one message string. The error pickles with its
    issues (an exception raised in a worker process arrives whole in the parent: pickle would
    otherwise rebuild it from the formatted text, read as a list of one-character issues)."""

    def __init__(self, issues, source: str = ""):
        if isinstance(issues, str):
            issues = [Issue("", issues)]
        self.issues = list(issues) if not isinstance(issues, Issue) else [issues]
        self.source = source
        where = f" ({source})" if source else ""
        if len(self.issues) == 1:
            text = f"invalid dsplug config{where}: {self.issues[0]}"
        else:
            lines = "\n".join(f"  - {issue}" for issue in self.issues)
            text = f"invalid dsplug config{where}: {len(self.issues)} errors\n{lines}"
        super().__init__(text)

    def __reduce__(self):
        return type(self), (self.issues, self.source), self.__dict__


# ------------------------------------------------------------------------------------- fields
def field(
    default=_NOTHING,
    *,
    factory: Optional[Callable[[], Any]] = None,
    doc: str = "",
    ge=None,
    gt=None,
    le=None,
    lt=None,
    choices=None,
    auto: bool = False,
    aliases: Tuple[str, ...] = (),
    check: Optional[Callable[[Any], Optional[str]]] = None,
    case_insensitive: bool = False,
    inert: Optional[str] = None,
    finite: bool = True,
    infinity=_NOTHING,
):
    """An attrs field carrying the metadata :func:`parse` enforces.

    ``finite=False`` lets non-finite floats and out-of-range integers through (the field checks
    its value itself, e.g. a free-form dict a later schema parses); by default every number in
    the value must be finite (see the module docstring). ``infinity=x`` accepts JSON
    ``Infinity`` (Python ``float("inf")``) and stores ``x`` instead: for keys where infinity
    has a meaning, like ``steps_per_print`` (never).

    ``check(value)`` may return an error message (or raise ValueError) for rules the other
    options cannot express. ``inert="why"`` marks a DeepSpeed key that dsplug accepts but that has
    no effect here: setting it to anything but its default gives a warning saying so, never silence. ``choices`` with ``case_insensitive`` accepts any capitalisation and
    stores the canonical spelling.
    """
    meta = dict(
        doc=doc, ge=ge, gt=gt, le=le, lt=lt, choices=tuple(choices) if choices is not None else None,
        auto=auto, aliases=tuple(aliases), check=check, case_insensitive=case_insensitive, inert=inert,
        finite=finite, infinity=infinity,
    )
    if factory is not None:
        return attrs.field(factory=factory, metadata={"dsplug": meta})
    if default is _NOTHING:
        return attrs.field(metadata={"dsplug": meta})
    if isinstance(default, (list, dict, set)):
        snapshot = default
        return attrs.field(factory=lambda: type(snapshot)(snapshot), metadata={"dsplug": meta})
    return attrs.field(default=default, metadata={"dsplug": meta})


def schema(cls=None, *, extra_keys: bool = False):
    """Class decorator: a frozen, keyword-only attrs class usable with :func:`parse`.

    ``extra_keys=True`` lets unknown keys through into ``__extra__`` (for free-form dicts whose
    keys a later stage checks, e.g. arguments of an arbitrary torch optimizer).
    """

    def wrap(c):
        c = attrs.frozen(kw_only=True)(c)
        c.__dsplug_extra_keys__ = extra_keys
        return c

    return wrap(cls) if cls is not None else wrap


def _meta(a: attrs.Attribute) -> Dict[str, Any]:
    return a.metadata.get("dsplug", {}) if a.metadata else {}


def fields_of(cls) -> Tuple[attrs.Attribute, ...]:
    attrs.resolve_types(cls)
    return attrs.fields(cls)


def key_map(cls) -> Dict[str, attrs.Attribute]:
    """Every accepted key (field names and aliases) -> field."""
    out = {}
    for a in fields_of(cls):
        out[a.name] = a
        for alias in _meta(a).get("aliases", ()):
            out[alias] = a
    return out


# ------------------------------------------------------------------------------------- types
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if attrs.has(tp):
        return "an object"
    if origin is Union:
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (list, tuple, List, Tuple):
        args = [t for t in typing.get_args(tp) if t is not Ellipsis]
        inner = _type_name(args[0]) if args else "values"
        if origin in (tuple, Tuple) and args and Ellipsis not in typing.get_args(tp):
            return f"a list of {len(args)} {inner.replace('a ', '').replace('an ', '')}"
        return f"a list of {inner}"
    if origin in (dict, Dict):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _show(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")  # JSON's spelling
    text = repr(value) if not isinstance(value, bool) else ("true" if value else "false")
    return text if len(text) <= 60 else text[:57] + "..."


class _Bad(Exception):
    """The value is not of the expected type (a union tries its next member)."""


class _Invalid(Exception):
    """The value has the expected type but cannot be used (not finite, out of 64 bits): reported
    at ``path`` (the offending element's) and never silently replaced by another union member."""

    def __init__(self, path: str, value, why: str):
        super().__init__(why)
        self.path, self.value, self.why = path, value, why

    def report(self, report: "Report") -> None:
        report.error(self.path, f"{_show(self.value)} is not valid: {self.why}")


def _check_numbers(value, path: str = "") -> None:
    """Raise :class:`_Invalid` for the first non-finite float or non-64-bit integer anywhere in
    ``value`` (dicts, lists, tuples walked without recursion, in document order)."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise _Invalid(p, v, _NOT_FINITE)
        elif isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                raise _Invalid(p, v, _INT_RANGE)
        elif isinstance(v, dict):
            stack.extend(reversed([(c, f"{p}.{k}" if p else str(k)) for k, c in v.items()]))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(c, f"{p}[{i}]") for i, c in enumerate(v)]))


#: strings DeepSpeed accepts for a boolean (any case): ``"enabled": "false"``, and ``ds_nvme_tune``
#: prints its ``aio`` block that way. Read as the boolean, with a warning that shows the JSON form.
_BOOLEAN_STRINGS = {"true": True, "false": False}


def boolean_from_string(value, path: str, report: Report):
    """The boolean a ``"true"`` / ``"false"`` string (any case) or the number ``1`` / ``0`` stands
    for, warning into ``report`` (DeepSpeed's config models take both silently); None for any other
    value."""
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        flag = bool(value)
        text = "true" if flag else "false"
        report.warn(path, f"{value} is a number; read as the JSON boolean {text} (write {text})")
        return flag
    if not isinstance(value, str) or value.lower() not in _BOOLEAN_STRINGS:
        return None
    flag = _BOOLEAN_STRINGS[value.lower()]
    text = "true" if flag else "false"
    report.warn(path, f"{value!r} is a string; read as the JSON boolean {text} (write {text} without quotes)")
    return flag


def _coerce(tp, value, path: str, report: Report, finite: bool = True):
    """Check ``value`` against annotation ``tp``; return the stored form or raise _Bad / _Invalid.

    With ``finite`` (the default) every number must be usable: floats finite, integers 64-bit."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        if finite:
            _check_numbers(value, path)
        return value
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        invalid = None
        nested = None  # (report, result) of a schema member the object parsed into, with errors
        if not isinstance(value, bool):  # a string or number a member takes as it is wins over a boolean
            args = tuple(sorted(args, key=lambda arg: arg is bool))
        for arg in args:
            if arg is type(None):
                continue
            try:
                probe = Report()
                result = _coerce(arg, value, path, probe, finite)
                if not probe.errors:
                    report.warnings.extend(probe.warnings)
                    report.notices.extend(probe.notices)
                    return result
                if attrs.has(arg) and isinstance(value, dict) and nested is None:
                    nested = (probe, result)
            except _Bad:
                continue
            except _Invalid as exc:  # right type, unusable value: say so unless another member fits
                invalid = invalid or exc
        if nested is not None:  # an object of the right schema with bad keys: report those keys
            report.errors.extend(nested[0].errors)
            return nested[1]
        if invalid is not None:
            raise invalid
        raise _Bad
    if tp is type(None):
        if value is None:
            return None
        raise _Bad
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise _Bad
    if attrs.has(tp):
        if not isinstance(value, dict):
            raise _Bad
        return parse(tp, value, path, report)
    if origin in (list, List, tuple, Tuple):
        if not isinstance(value, (list, tuple)):
            raise _Bad
        args = typing.get_args(tp)
        if origin in (tuple, Tuple) and args and Ellipsis not in args:
            if len(value) != len(args):
                raise _Bad
            return tuple(_coerce(a, v, f"{path}[{i}]", report, finite) for i, (a, v) in enumerate(zip(args, value)))
        inner = args[0] if args else Any
        items = [_coerce(inner, v, f"{path}[{i}]", report, finite) for i, v in enumerate(value)]
        return tuple(items) if origin in (tuple, Tuple) else items
    if origin in (dict, Dict) or tp is dict:
        if not isinstance(value, dict):
            raise _Bad
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is not Any:  # Dict[str, Schema]: each value parsed by its type
            return {key: _coerce(args[1], item, f"{path}.{key}", report, finite) for key, item in value.items()}
        if finite:
            _check_numbers(value, path)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        flag = boolean_from_string(value, path, report)
        if flag is None:
            raise _Bad
        return flag
    if tp is int:
        if isinstance(value, bool):
            raise _Bad
        if isinstance(value, float):
            if not math.isfinite(value):
                if not finite:
                    raise _Bad
                raise _Invalid(path, value, _NOT_FINITE)
            if not value.is_integer():
                raise _Bad
            stored = int(value)
        elif isinstance(value, int):
            stored = int(value)
        else:
            raise _Bad
        if finite and not INT_MIN <= stored <= INT_MAX:
            raise _Invalid(path, value, _INT_RANGE)
        return stored
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad
        try:
            stored = float(value)
        except OverflowError:  # an int beyond 1.8e308
            raise _Invalid(path, value, _FLOAT_RANGE) from None
        if finite and not math.isfinite(stored):
            raise _Invalid(path, value, _NOT_FINITE)
        return stored
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Bad
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Bad
    if finite:
        _check_numbers(value, path)
    return value


def _bound(limit) -> str:
    """A bound as the message shows it: a large power of two as ``2**127``, else as written."""
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 2 ** 20 and limit & (limit - 1) == 0:
        return f"2**{limit.bit_length() - 1}"
    if isinstance(limit, float) and limit > 0 and math.isfinite(limit):
        exponent = math.log2(limit)
        if exponent.is_integer() and abs(exponent) >= 20:
            return f"2**{int(exponent)}"
    return str(limit)


def _check_value(a: attrs.Attribute, value, path: str, report: Report, given=_NOTHING) -> bool:
    """Range / custom checks on the stored ``value``; messages show the ``given`` JSON value."""
    m = _meta(a)
    valid = True
    shown = _show(value if given is _NOTHING else given)

    def bad(why: str):
        nonlocal valid
        valid = False
        report.error(path, f"{shown} is not valid: {why}")

    def is_number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if is_number(value):
        numbers = [(value, "")]
    elif isinstance(value, (list, tuple)):  # bounds hold for each number of a list (one per group)
        numbers = [(v, f" (got {_show(v)} at index {i})") for i, v in enumerate(value) if is_number(v)]
    else:
        numbers = []
    for number, where in numbers:
        if m.get("ge") is not None and number < m["ge"]:
            bad(f"must be >= {_bound(m['ge'])}{where}")
        elif m.get("gt") is not None and number <= m["gt"]:
            bad(f"must be > {_bound(m['gt'])}{where}")
        elif m.get("le") is not None and number > m["le"]:
            bad(f"must be <= {_bound(m['le'])}{where}")
        elif m.get("lt") is not None and number >= m["lt"]:
            bad(f"must be < {_bound(m['lt'])}{where}")
        else:
            continue
        break
    check = m.get("check")
    if valid and check is not None:
        try:
            why = check(value)
        except ValueError as exc:
            why = str(exc)
        if why:
            bad(why)
    return valid


def _canonical_choice(a: attrs.Attribute, value, path: str, report: Report):
    m = _meta(a)
    choices = m.get("choices")
    if choices is None or value is None:
        return value, True
    if m.get("case_insensitive") and isinstance(value, str):
        for choice in choices:
            if isinstance(choice, str) and choice.lower() == value.lower():
                return choice, True
    if value in choices:
        return value, True
    guess = suggest(str(value), [str(c) for c in choices])
    hint = f" (did you mean {guess!r}?)" if guess else ""
    report.error(path, f"{_show(value)} is not valid{hint}: must be one of {', '.join(repr(c) for c in choices)}")
    return value, False


def parse(cls, data, path: str = "", report: Optional[Report] = None):
    """Parse ``data`` (a dict from JSON) into an instance of schema class ``cls``.

    Errors go into ``report``; if it was not given, a :class:`ConfigError` is raised at the end.
    A field with an error keeps its default so that parsing can continue and report the rest.
    """
    own_report = report is None
    report = Report() if own_report else report
    errors_before = len(report.errors)
    legacy = getattr(cls, "__legacy__", None)
    if legacy is not None:
        data = legacy(data, path, report)
    if not isinstance(data, dict):
        report.error(path, f"{_show(data)} is not valid: expected an object with keys "
                     f"{', '.join(sorted(a.name for a in fields_of(cls)))}")
        return _defaults(cls) if not own_report else report.raise_if_errors()
    keys = key_map(cls)
    values: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    seen_from: Dict[str, str] = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        a = keys.get(key)
        if a is None:
            if getattr(cls, "__dsplug_extra_keys__", False):
                try:
                    _check_numbers(value, sub)
                except _Invalid as exc:
                    exc.report(report)
                    continue
                extra[key] = value
                continue
            guess = suggest(str(key), [k for k in keys])
            if guess:
                report.error(sub, f"unknown key; did you mean {(path + '.' if path else '') + guess!r}?")
            else:
                valid = ", ".join(sorted(a.name for a in fields_of(cls)))
                report.error(sub, f"unknown key. Valid keys here: {valid}")
            continue
        if a.name in seen_from:
            report.error(sub, f"given twice (also as {seen_from[a.name]!r})")
            continue
        seen_from[a.name] = key
        if is_auto(value):
            if _meta(a).get("auto"):
                values[a.name] = AUTO
            else:
                report.error(sub, '"auto" is not accepted here; give a concrete value')
            continue
        meta = _meta(a)
        if (meta.get("infinity", _NOTHING) is not _NOTHING and isinstance(value, float)
                and not isinstance(value, bool) and value == math.inf):
            values[a.name] = meta["infinity"]  # JSON Infinity, meaningful for this key
            continue
        try:
            stored = _coerce(a.type, value, sub, report, meta.get("finite", True))
        except _Bad:
            report.error(sub, f"{_show(value)} is not valid: expected {_type_name(a.type)}")
            continue
        except _Invalid as exc:
            exc.report(report)
            continue
        stored, ok = _canonical_choice(a, stored, sub, report)
        if ok and _check_value(a, stored, sub, report, given=value):
            values[a.name] = stored
            inert = _meta(a).get("inert")
            if inert and stored != a.default:
                report.notice(sub, f"{_show(value)} has no effect in dsplug ({inert}); the setting is ignored")
    for a in fields_of(cls):
        if a.name not in values and a.default is attrs.NOTHING:
            sub = f"{path}.{a.name}" if path else a.name
            report.error(sub, f"required key is missing ({_meta(a).get('doc') or _type_name(a.type)})")
    try:
        instance = cls(**{k: v for k, v in values.items()})
    except TypeError:  # a required field missing: already reported
        instance = _defaults(cls)
    if extra:
        object.__setattr__(instance, "__extra__", extra)
    if instance is not None and len(report.errors) == errors_before:
        _run_schema_rules(cls, instance, path, report)
    if own_report:
        report.raise_if_errors()
    return instance


def _run_schema_rules(cls, instance, path: str, report: Report) -> None:
    """``cls.__rules__``: callables ``rule(values) -> (key, message) | iterable of them | None``
    over the parsed field values (``"auto"`` stays ``"auto"``), for relations between fields.
    They run only when every field parsed cleanly, so they never see a replaced default."""
    values = to_dict(instance)
    for rule in getattr(cls, "__rules__", ()):
        found = rule(values)
        if found is None:
            continue
        problems = [found] if isinstance(found, tuple) and len(found) == 2 and isinstance(found[0], str) else found
        for key, message in problems:
            report.error(f"{path}.{key}" if path else key, message)


def _defaults(cls):
    try:
        return cls()
    except TypeError:
        return None


def extra_of(instance) -> Dict[str, Any]:
    return dict(getattr(instance, "__extra__", {}) or {})


def to_dict(instance) -> Dict[str, Any]:
    """The JSON form of a parsed schema instance (inverse of :func:`parse`)."""

    def convert(value):
        if attrs.has(type(value)):
            return to_dict(value)
        if isinstance(value, tuple):
            return [convert(v) for v in value]
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    out = {a.name: convert(getattr(instance, a.name)) for a in fields_of(type(instance))}
    out.update(extra_of(instance))
    return out


def describe(cls, prefix: str = "") -> List[Tuple[str, str, str, str]]:
    """(path, type, default, doc) for every field, nested sections flattened (for docs / explain)."""
    rows = []
    for a in fields_of(cls):
        path = f"{prefix}.{a.name}" if prefix else a.name
        if attrs.has(a.type):
            rows.extend(describe(a.type, path))
            continue
        default = a.default.factory() if isinstance(a.default, attrs.Factory) else a.default
        rows.append((path, _type_name(a.type), repr(default), _meta(a).get("doc", "")))
    return rows


def replace(instance, **changes):
    """A copy of a frozen schema instance with some fields changed (keeps ``__extra__``)."""
    new = attrs.evolve(instance, **changes)
    if getattr(instance, "__extra__", None):
        object.__setattr__(new, "__extra__", dict(instance.__extra__))
    return new
