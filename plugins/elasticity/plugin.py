"""Registers elastic training: the ``elasticity`` section, its batch sizes, DeepSpeed's import paths.

Entry point: ``elasticity = "dsplug.plugins.elasticity.plugin"``. Cheap to import (no torch).

With ``"elasticity": {"enabled": true, ...}`` the batch triple is this plugin's answer to the
kernel's ``dsplug_batch_sizes`` hook (:mod:`.batch`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from . import constants as C
from .config import ElasticitySection


@hookimpl
def dsplug_api_modules():
    """``dsplug.elasticity`` (= ``deepspeed.elasticity``) and its submodules."""
    return [ApiModule("dsplug.elasticity", "dsplug.plugins.elasticity.api"),
            ApiModule("dsplug.elasticity.elasticity", "dsplug.plugins.elasticity.elasticity"),
            ApiModule("dsplug.elasticity.config", "dsplug.plugins.elasticity.config"),
            ApiModule("dsplug.elasticity.constants", "dsplug.plugins.elasticity.constants")]


def _deepspeed_config(config) -> Dict[str, Any]:
    """DeepSpeed's ``DeepSpeedConfig`` attribute of the section: ``elasticity_enabled``."""
    return {"elasticity_enabled": (config.get(C.ELASTICITY) or {}).get("enabled") is True}


@hookimpl
def dsplug_cli_commands():
    from .cli import ELASTIC

    return [ELASTIC]


@hookimpl
def dsplug_config_sections():
    return [PluginSpec(category="section", name=C.ELASTICITY, section=C.ELASTICITY, schema=ElasticitySection,
                       deepspeed_config=_deepspeed_config,
                       summary="elastic training: one batch size valid over a range of GPU counts")]


@hookimpl
def dsplug_batch_sizes(config, world_size, report) -> Optional[Dict[str, Any]]:
    """The elastic batch triple at ``world_size`` (None when elasticity is not enabled)."""
    from .batch import elastic_batch_sizes

    return elastic_batch_sizes(config, world_size, report)
