"""DeepSpeed's ``deepspeed.profiling.flops_profiler.profiler`` import path (the same names as
:mod:`dsplug.profiling.flops_profiler`, from the plugin that declares this path)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
