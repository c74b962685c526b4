"""DeepSpeed's ``deepspeed.runtime.config_utils``: :class:`DeepSpeedConfigModel`, the pydantic
base class DeepSpeed's config sections -- and third-party code extending them -- are written with.

dsplug's own config sections are attrs schemas (:mod:`dsplug.config.schema`); this class is for
code written against DeepSpeed's base class. Its rules:

* unknown keys are refused (``extra="forbid"``), a field may be given by its name or its alias,
  assignments are validated, enum fields hold their values;
* a field marked deprecated -- ``Field(..., json_schema_extra={"deprecated": True, "new_param":
  "new_name", "new_param_fn": fn})`` -- is still accepted: a warning names its replacement, and
  its value (through ``fn``, when given) moves to ``new_param``; giving both the deprecated field
  and its replacement is an error (an ``AssertionError``, as in DeepSpeed), since one would
  silently win.

Needs pydantic 2 (``pip install pydantic``), which dsplug itself does not use.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

try:
    from pydantic import BaseModel, ConfigDict, model_validator
except ImportError as exc:  # pragma: no cover - exercised only without pydantic
    raise ImportError("deepspeed.runtime.config_utils (DeepSpeedConfigModel) is a pydantic model: "
                      f"install pydantic 2 (pip install pydantic) to use it ({exc})") from exc

__all__ = ["DeepSpeedConfigModel", "get_scalar_param", "get_list_param", "get_dict_param"]


def _extra(field) -> Dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


class DeepSpeedConfigModel(BaseModel):
    """Base class of a config section as a pydantic model (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              validate_default=True, use_enum_values=True, arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data):
        if not strict:  # DeepSpeed's models drop keys given as "auto" unless strict
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        # here rather than only in the validator: pydantic would turn the AssertionError for a
        # deprecated field given with its replacement into a ValidationError
        super().__init__(**self._move_deprecated_fields(data))

    @model_validator(mode="before")
    @classmethod
    def _move_deprecated_fields(cls, data):
        """Deprecated fields -> their replacements (see the module docstring)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, field in cls.model_fields.items():
            extra = _extra(field)
            if not extra.get("deprecated"):
                continue
            given = name if name in data else (field.alias if field.alias and field.alias in data else None)
            if given is None:
                continue
            new = extra.get("new_param")
            if not new:
                warnings.warn(f"config field {given!r} is deprecated: {extra.get('deprecated_msg', 'remove it')}",
                              DeprecationWarning, stacklevel=3)
                continue
            new_field = cls.model_fields.get(new)
            new_keys = {new} | ({new_field.alias} if new_field is not None and new_field.alias else set())
            assert not (new_keys & set(data)), (
                f"config fields {given!r} (deprecated) and {new!r} (its replacement) are both given: keep only {new!r}")
            warnings.warn(f"config field {given!r} is deprecated, use {new!r} instead", DeprecationWarning,
                          stacklevel=3)
            value = data.pop(given)
            fn = extra.get("new_param_fn")
            data[new] = fn(value) if callable(fn) else value
        return data


def get_scalar_param(param_dict: Dict[str, Any], param_name: str, param_default_value):
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Dict[str, Any], param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Dict[str, Any], param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)
