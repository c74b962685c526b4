"""DeepSpeed's ``deepspeed.launcher.runner``: ``fetch_hostfile``, ``parse_resource_filter``,
``parse_inclusion_exclusion``, ``encode_world_info``, ``parse_args``, ``main`` ...

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the launcher plugin behind ``dsplug launch``); they are
resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
