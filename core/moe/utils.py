"""``dsplug.moe.utils`` (``deepspeed.moe.utils``): ``is_moe_param``,
``split_params_into_different_moe_groups_for_optimizer``, ..., from the plugin declaring this path."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
