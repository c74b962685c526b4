"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``fp16`` / ``bf16`` sections of a config
dict, parsed by this plugin's schemas (:class:`.plugins.Fp16Config`, :class:`.plugins.Bf16Config`).

``get_bfloat16_config(param_dict)`` reads ``bf16`` or its legacy spelling ``bfloat16`` (giving both
is an error: one would silently win); a missing section gives the defaults (``enabled`` false).
A bad value raises :class:`dsplug.config.ConfigError` naming the key.
"""
from __future__ import annotations

from typing import Any, Dict

from dsplug.config.schema import parse

from .config import Bf16Config, Fp16Config

__all__ = ["get_bfloat16_config", "get_float16_config", "Bf16Config", "Fp16Config"]


def _section(param_dict: Dict[str, Any], names):
    given = [n for n in names if n in (param_dict or {})]
    if len(given) > 1:
        from dsplug.config import ConfigError

        raise ConfigError(f"the config has both {given[0]!r} and {given[1]!r}: they are one section "
                          f"({given[1]!r} is the legacy name); keep only {names[0]!r}")
    return (given[0], param_dict[given[0]]) if given else (names[0], {})


def get_bfloat16_config(param_dict: Dict[str, Any]) -> Bf16Config:
    """The ``bf16`` (or ``bfloat16``) section of ``param_dict`` as a :class:`Bf16Config`."""
    name, section = _section(param_dict, ("bf16", "bfloat16"))
    return parse(Bf16Config, section, path=name)


def get_float16_config(param_dict: Dict[str, Any]) -> Fp16Config:
    """The ``fp16`` section of ``param_dict`` as an :class:`Fp16Config`."""
    name, section = _section(param_dict, ("fp16",))
    return parse(Fp16Config, section, path=name)
