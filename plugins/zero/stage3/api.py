"""The names of ``dsplug.zero`` (DeepSpeed's ``deepspeed.zero``), provided by the ZeRO stage-3 plugin.

* :class:`Init` — build modules already partitioned over the data-parallel ranks;
* :class:`GatheredParameters` — gather partitioned parameters to read them, or to change them on
  one rank and re-partition;
* :func:`register_external_parameter` / :func:`unregister_external_parameter` — a forward that
  uses another module's parameter;
* :class:`ZeroParamStatus`, :func:`is_zero_param` — inspect a parameter.

These work on the partitioned-parameter representation of :mod:`.partitioned_param`; the stage-3
plugin (``zero_optimization.stage: 3``) drives the gathering during training. The kernel's
``dsplug.zero`` forwards to this module (declared by :func:`.plugin.dsplug_api_modules`).
"""
from .external import register_external_parameter, unregister_external_parameter
from .gathered import GatheredParameters
from .init import Init
from .partitioned_param import ZeroParamStatus, is_partitioned as is_zero_param

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "is_zero_param"]
