"""``dsplug.moe`` (DeepSpeed's ``deepspeed.moe``): mixture-of-experts layers.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: :mod:`dsplug.plugins.moe`); they are resolved on first
use (see :mod:`dsplug.public`). Submodules: ``layer`` (``MoE``), ``sharded_moe`` (``TopKGate``,
``MOELayer``, ``top1gating`` / ``top2gating`` / ``topkgating``), ``experts`` (``Experts``),
``utils`` (``is_moe_param``, ``split_params_into_different_moe_groups_for_optimizer``).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
