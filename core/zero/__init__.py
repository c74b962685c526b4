"""``dsplug.zero``: DeepSpeed's ``deepspeed.zero`` API for ZeRO stage 3.

* :class:`Init` — build modules already partitioned over the data-parallel ranks;
* :class:`GatheredParameters` — gather partitioned parameters to read them, or to change them on
  one rank and re-partition;
* :func:`register_external_parameter` / :func:`unregister_external_parameter` — a forward that
  uses another module's parameter;
* :class:`ZeroParamStatus`, :func:`is_zero_param` — inspect a parameter.

These work on the partitioned-parameter representation of :mod:`dsplug.zero.partitioned_param`;
the stage-3 plugin (``zero_optimization.stage: 3``) drives the gathering during training.
"""
from __future__ import annotations

from .external import register_external_parameter, unregister_external_parameter
from .gathered import GatheredParameters
from .init import Init
from .partitioned_param import ZeroParamStatus, is_partitioned as is_zero_param

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "is_zero_param"]
