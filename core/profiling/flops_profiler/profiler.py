"""DeepSpeed's ``deepspeed.profiling.flops_profiler.profiler`` module path (same names)."""
from dsplug.profiling.flops_profiler import (FlopsProfiler, bytes_to_string, duration_to_string,  # noqa: F401
                                             flops_to_string, get_model_profile, get_module_duration,
                                             get_module_flops, get_module_macs, get_module_params,
                                             macs_to_string, number_to_string, params_to_string)

__all__ = [
    "FlopsProfiler", "get_model_profile", "get_module_flops", "get_module_macs", "get_module_params",
    "get_module_duration", "number_to_string", "macs_to_string", "flops_to_string", "params_to_string",
    "duration_to_string", "bytes_to_string",
]
