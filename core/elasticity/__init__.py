"""``dsplug.elasticity``: DeepSpeed's ``deepspeed.elasticity`` API (``compute_elastic_config``,
``elasticity_enabled``, ``ensure_immutable_elastic_config``, the ``Elasticity*Error`` classes).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the elasticity plugin); they are resolved on first use
(see :mod:`dsplug.public`). Submodules: ``elasticity``, ``config``, ``constants``.
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
