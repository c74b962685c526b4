"""DeepSpeed's ``deepspeed.runtime.zero.config`` names, over this plugin's ``zero_optimization``
schema (:mod:`.config`); the kernel's ``dsplug.runtime.zero.config`` forwards here.

``DeepSpeedZeroConfig(**zero_optimization)`` parses the section exactly as a config file's section
is parsed (strict keys, ranges, legacy forms; a :class:`dsplug.config.ConfigError` names every
problem) and answers DeepSpeed's attribute names: the ``stage3_`` prefixed keys under their short
names too (``prefetch_bucket_size``, ``param_persistence_threshold``,
``gather_16bit_weights_on_model_save`` ...), ``stage`` as a :class:`ZeroStageEnum`, and
``offload_param`` / ``offload_optimizer`` as the offload configs (None when the section leaves them
out, as in DeepSpeed) whose ``device`` is an :class:`OffloadDeviceEnum`.
"""
from __future__ import annotations

import enum
from typing import Any, Dict, Optional

from dsplug.config.schema import parse, to_dict

from .config import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig


class ZeroStageEnum(int, enum.Enum):
    """The ZeRO stages by what they partition."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    """Where ``offload_param`` / ``offload_optimizer`` put their tensors."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _Parsed:
    """A parsed schema instance under DeepSpeed's attribute names (read-only)."""

    _schema: Any = None
    _path = ""
    _short: Dict[str, str] = {}

    def __init__(self, data: Optional[Dict[str, Any]] = None, _log_issues: bool = True, **kwargs):
        from dsplug.config.schema import Report
        from dsplug.logging import logger

        given = dict(data or {}, **kwargs)
        object.__setattr__(self, "_given", given)
        report = Report()
        object.__setattr__(self, "_parsed", parse(self._schema, given, self._path, report))
        report.raise_if_errors()
        # DeepSpeed's config models log their deprecations on its logger; so do these, unless the
        # section comes from a whole config, which has warned already (as warnings)
        for issue in list(report.warnings) + list(report.notices) if _log_issues else ():
            logger.warning(str(issue))

    def __getattr__(self, name: str):
        parsed = self.__dict__.get("_parsed")
        if parsed is None:
            raise AttributeError(name)
        return getattr(parsed, self._short.get(name, name))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only; build a new one with the changed keys")

    def model_dump(self) -> Dict[str, Any]:
        """The section as JSON data, defaults filled in."""
        return to_dict(self._parsed)

    dict = model_dump

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_dump()!r})"


class _OffloadConfig(_Parsed):
    @property
    def device(self) -> OffloadDeviceEnum:
        return OffloadDeviceEnum(self._parsed.device)


class DeepSpeedZeroOffloadParamConfig(_OffloadConfig):
    """``zero_optimization.offload_param``."""

    _schema = OffloadParamConfig
    _path = "zero_optimization.offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadConfig):
    """``zero_optimization.offload_optimizer``."""

    _schema = OffloadOptimizerConfig
    _path = "zero_optimization.offload_optimizer"


class DeepSpeedZeroConfig(_Parsed):
    """``zero_optimization``: DeepSpeed's ZeRO config model."""

    _schema = ZeroConfig
    _path = "zero_optimization"
    _short = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
    }

    def __init__(self, data: Optional[Dict[str, Any]] = None, _log_issues: bool = True, **kwargs):
        super().__init__(data, _log_issues, **kwargs)
        value = self._parsed.stage
        if str(value) not in ("0", "1", "2", "3"):  # another stage must be an installed plugin
            from dsplug.config.schema import Report
            from dsplug.registry import get_registry

            registry = get_registry()
            if registry.find("zero_stage", str(value)) is None:
                report = Report()
                report.error(f"{self._path}.stage", registry.miss_message("zero_stage", str(value)))
                report.raise_if_errors()

    @property
    def stage(self) -> ZeroStageEnum:
        """DeepSpeed's enum: 0-3 as written; another stage plugin's name answers its traits' number."""
        value = self._parsed.stage
        if str(value) in ("0", "1", "2", "3"):
            return ZeroStageEnum(int(value))
        from dsplug.contracts.zero_stage import NO_TRAITS, traits_of_spec
        from dsplug.registry import get_registry

        provided = get_registry().find("zero_stage", str(value))
        traits = traits_of_spec(provided) if provided is not None else NO_TRAITS
        return ZeroStageEnum(traits.zero_optimization_stage())

    def _offload(self, key: str, cls):
        given = self._given.get(key)
        legacy = {"offload_param": ("cpu_offload_param", "cpu_offload_params"),
                  "offload_optimizer": ("cpu_offload",)}[key]
        if given is None and not any(self._given.get(old) for old in legacy):
            return None
        return cls(to_dict(getattr(self._parsed, key)), _log_issues=False)

    @property
    def offload_param(self) -> Optional[DeepSpeedZeroOffloadParamConfig]:
        return self._offload("offload_param", DeepSpeedZeroOffloadParamConfig)

    @property
    def offload_optimizer(self) -> Optional[DeepSpeedZeroOffloadOptimizerConfig]:
        return self._offload("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig)

    @property
    def cpu_offload(self) -> bool:
        offload = self.offload_optimizer
        return offload is not None and offload.device == OffloadDeviceEnum.cpu

    @property
    def cpu_offload_param(self) -> bool:
        offload = self.offload_param
        return offload is not None and offload.device == OffloadDeviceEnum.cpu


def get_zero_config(param_dict: Dict[str, Any]) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` section of a whole config dict (DeepSpeed's helper)."""
    section = (param_dict or {}).get("zero_optimization", {})
    if isinstance(section, bool):
        section = {"stage": 1 if section else 0}
    return DeepSpeedZeroConfig(section)


#: DeepSpeed's section key and defaults, for scripts that read them from this module
ZERO_OPTIMIZATION = "zero_optimization"

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum", "ZERO_OPTIMIZATION", "get_zero_config"]


def deepspeed_config_attributes(config) -> Dict[str, Any]:
    """DeepSpeed's ``DeepSpeedConfig`` attributes of the ``zero_optimization`` section
    (``PluginSpec.deepspeed_config``): the stage, whether ZeRO is on, and the section as DeepSpeed's
    ``DeepSpeedZeroConfig`` (parsed as given: an absent offload stays None)."""
    from dsplug.contracts.zero_stage import selected_traits

    traits = selected_traits(config)  # a named stage plugin answers its traits' DeepSpeed number (0-3)
    stage = traits.zero_optimization_stage() if traits is not None else 0
    section = config.raw.get("zero_optimization") or {}
    return {
        "zero_optimization_stage": stage,
        "zero_enabled": stage > 0,
        "zero_config": DeepSpeedZeroConfig({"stage": 1 if section else 0} if isinstance(section, bool) else dict(section),
                                           _log_issues=False),
    }
