"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` import path: the names
of ``dsplug.checkpointing``, from the plugin that declares this path through the
``dsplug_api_modules`` hook, resolved on first use (see :mod:`dsplug.public`)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
