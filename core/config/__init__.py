"""Strict DeepSpeed-format configuration: schemas, loading, ``"auto"`` values, rules."""
from .auto import fill_auto
from .batch import infer_batch
from .dsconfig import DsplugConfig, DsplugConfigWarning, DsplugDeprecationWarning, Selected, check_config
from .schema import AUTO, ConfigError, Issue, Report, field, is_auto, parse, schema, to_dict

__all__ = [
    "AUTO", "ConfigError", "DsplugConfig", "DsplugConfigWarning", "DsplugDeprecationWarning", "Issue", "Report", "Selected",
    "check_config", "field", "fill_auto", "infer_batch", "is_auto", "parse", "schema", "to_dict",
]
