"""DeepSpeed's import path ``deepspeed.utils.zero_to_fp32``: rebuild full fp32 weights from a
partitioned ZeRO checkpoint (``get_fp32_state_dict_from_zero_checkpoint``,
``load_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict``, ...).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO plugin's ``zero_to_fp32``
module; the plugin owns the partitioned checkpoint format); they are resolved on first use.
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
