"""``dsplug.compression``: DeepSpeed's ``deepspeed.compression`` API (``init_compression``,
``redundancy_clean``, ``student_initialization``).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the compression plugins' ``api`` module); they are
resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
