"""``dsplug.elasticity`` (DeepSpeed's ``deepspeed.elasticity``): the names a DeepSpeed script or a
resource scheduler imports.

``DSElasticAgent`` (DeepSpeed's subclass of torch's elastic agent) is not provided: dsplug runs
elastic jobs with torch's own agent, started by ``dsplug launch --elastic_training``; asking for
it raises an ImportError that says so.
"""
from __future__ import annotations

import importlib.util

from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import ELASTICITY, ENABLED, ENABLED_DEFAULT, LATEST_ELASTICITY_VERSION
from .elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config


def is_torch_elastic_compatible() -> bool:
    """Whether torch has the elastic launcher (``torch.distributed.run``, torch >= 1.10) that
    ``dsplug launch --elastic_training`` runs on."""
    try:
        return importlib.util.find_spec("torch.distributed.run") is not None
    except ModuleNotFoundError:
        return False


def __getattr__(name: str):
    if name == "DSElasticAgent":
        from dsplug.unavailable import NotAvailableInDsplug

        raise NotAvailableInDsplug(
            "deepspeed.elasticity.DSElasticAgent is not available in dsplug: elastic jobs run on torch's own "
            "elastic agent (torch.distributed.run); start them with `dsplug launch --elastic_training "
            "--min_elastic_nodes N --max_elastic_nodes M ...`", name="dsplug.elasticity.DSElasticAgent")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "LATEST_ELASTICITY_VERSION", "ElasticityConfig",
           "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "compute_elastic_config",
           "elasticity_enabled", "ensure_immutable_elastic_config", "is_torch_elastic_compatible"]
