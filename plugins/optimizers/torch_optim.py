"""Every other ``torch.optim`` optimizer, selected by its class name (DeepSpeed's fallback).

DeepSpeed builds ``getattr(torch.optim, type)(params, **params)`` for a type it does not implement
itself. Here each such class is a plugin of its own whose ``optimizer.params`` schema is derived
from the constructor signature: an unknown or misspelled argument is an error with a suggestion,
and each value is type-checked against the annotation (or, without one, the default's type).

DeepSpeed has not tested these with ZeRO, so each spec carries a rule refusing them under
``zero_optimization.stage`` > 0 unless ``zero_allow_untested_optimizer`` is true.
"""
from __future__ import annotations

import ast
import functools
from typing import Any, List, Optional, Tuple, Union

from dsplug import PluginSpec
from dsplug.config.params import options_of, selected_optimizer_type
from dsplug.config.schema import field, schema

from .common import call_torch_optimizer, untested_with_zero
from .torch_signatures import REQUIRED, Argument, OptimizerSignature, optimizer_signatures

#: Types provided by dsplug's own optimizer plugins (adam, sgd, adagrad modules).
NATIVE = ("Adam", "AdamW", "SGD", "Adagrad")

#: Optimizers whose ``step()`` needs a closure re-evaluating the model; the engine has none.
NEEDS_CLOSURE = ("LBFGS",)

#: Keys the Hugging Face integration may set to "auto".
AUTO_KEYS = ("lr", "betas", "eps", "weight_decay")

_SIMPLE = {"float": float, "int": int, "bool": bool, "str": str, "None": type(None)}
_TENSOR = {"Tensor", "torch.Tensor"}  # a JSON config cannot hold one: the other members remain
_UNKNOWN = object()
_DROP = object()


# ------------------------------------------------------------------------- types from signatures
def _union(members) -> Any:
    if any(m is _UNKNOWN for m in members):
        return _UNKNOWN
    kept = []
    for m in members:
        if m is not _DROP and m not in kept:
            kept.append(m)
    if not kept:
        return _UNKNOWN
    return kept[0] if len(kept) == 1 else Union[tuple(kept)]


def _from_node(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, (ast.Name, ast.Attribute)):
        text = ast.unparse(node)
        if text in _TENSOR:
            return _DROP
        if text in ("Any", "typing.Any"):
            return Any
        return _SIMPLE.get(text.split(".")[-1] if text.startswith("builtins.") else text, _UNKNOWN)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_from_node(node.left), _from_node(node.right)])
    if isinstance(node, ast.Subscript):
        base = ast.unparse(node.value).split(".")[-1]
        items = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Optional":
            return _union([_from_node(items[0]), type(None)])
        if base == "Union":
            return _union([_from_node(i) for i in items])
        if base in ("tuple", "Tuple"):
            if len(items) == 2 and isinstance(items[1], ast.Constant) and items[1].value is Ellipsis:
                inner = _from_node(items[0])
                return _UNKNOWN if inner in (_UNKNOWN, _DROP) else Tuple[inner, ...]
            inner = [_from_node(i) for i in items]
            return _UNKNOWN if any(i in (_UNKNOWN, _DROP) for i in inner) else Tuple[tuple(inner)]
        if base in ("list", "List"):
            inner = _from_node(items[0])
            return _UNKNOWN if inner in (_UNKNOWN, _DROP) else List[inner]
    return _UNKNOWN


def _from_default(value) -> Any:
    if value is REQUIRED or value is None:
        return Any
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return Union[int, float]  # an int default of a numeric argument also takes 0.5
    if isinstance(value, (float, str)):
        return type(value)
    if isinstance(value, tuple):
        return Tuple[tuple(_from_default(v) for v in value)]
    return Any


def value_type(argument: Argument) -> Any:
    """The schema type of one constructor argument: its annotation, else its default's type."""
    if argument.annotation is not None:
        try:
            derived = _from_node(ast.parse(argument.annotation, mode="eval").body)
        except SyntaxError:
            derived = _UNKNOWN
        if derived is not _UNKNOWN and derived is not _DROP:
            if argument.default is None and derived is not Any:
                derived = Optional[derived]
            return derived
    return _from_default(argument.default)


def derive_schema(signature: OptimizerSignature) -> type:
    """A strict params schema class with one field per constructor argument."""
    annotations = {}
    namespace: dict = {
        "__annotations__": annotations,
        "__module__": __name__,
        "__doc__": f"``optimizer.params`` for ``\"type\": \"{signature.name}\"`` "
                   f"(derived from torch.optim.{signature.name}.__init__).",
    }
    for argument in signature.arguments:
        annotations[argument.name] = value_type(argument)
        doc = f"torch.optim.{signature.name} argument {argument.name}"
        auto = argument.name in AUTO_KEYS
        if argument.default is REQUIRED:
            namespace[argument.name] = field(auto=auto, doc=doc + " (required)")
        else:
            namespace[argument.name] = field(argument.default, auto=auto, doc=doc)
    return schema(type(f"{signature.name}Params", (), namespace))


# ----------------------------------------------------------------------------------- factories
def build_torch_optimizer(name: str, params, config, context=None):
    import torch.optim

    return call_torch_optimizer(getattr(torch.optim, name), params, options_of(config, name), name)


def _closure_message(name: str) -> str:
    return (
        f"torch.optim.{name} re-evaluates the model through a closure passed to step(), and the "
        "engine's step() has no closure to pass: dsplug does not support it. Choose another "
        "optimizer.type."
    )


def refuse_needs_closure(name: str, params, config, context=None):
    raise ValueError(f"optimizer.type = {name!r}: {_closure_message(name)}")


def _needs_closure_rule(name: str):
    wanted = name.lower()

    def rule(config, report) -> None:
        chosen = selected_optimizer_type(config)
        if chosen is not None and chosen.strip().lower() == wanted:
            report.error("optimizer.type", f"{chosen!r}: {_closure_message(name)}")

    rule.__name__ = f"needs_closure[{name}]"
    return rule


def torch_optimizer_specs() -> List[PluginSpec]:
    """One spec per torch.optim optimizer class dsplug does not provide natively."""
    return list(_specs())


@functools.lru_cache(maxsize=None)
def _specs() -> Tuple[PluginSpec, ...]:
    native = {n.lower() for n in NATIVE}
    specs = []
    for name, signature in sorted(optimizer_signatures().items()):
        if name.lower() in native:
            continue
        rules = [untested_with_zero([name], f"torch.optim.{name}")]
        factory = functools.partial(build_torch_optimizer, name)
        summary = f"torch.optim.{name} (by name; untested with ZeRO)"
        if name in NEEDS_CLOSURE:
            rules.append(_needs_closure_rule(name))
            factory = functools.partial(refuse_needs_closure, name)
            summary = f"torch.optim.{name}: not supported (its step() needs a closure)"
        specs.append(
            PluginSpec(
                category="optimizer",
                name=name,
                factory=factory,
                schema=derive_schema(signature),
                summary=summary,
                rules=rules,
            )
        )
    return tuple(specs)

