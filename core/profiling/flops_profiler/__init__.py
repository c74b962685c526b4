"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: the flops profiler plugin's public API."""
from dsplug.plugins.profilers.flops_profiler.formatting import (bytes_to_string, duration_to_string,
                                                                flops_to_string, macs_to_string,
                                                                number_to_string, params_to_string)
from dsplug.plugins.profilers.flops_profiler.profiler import (FlopsProfiler, get_module_duration,
                                                              get_module_flops, get_module_macs,
                                                              get_module_params)
from dsplug.plugins.profilers.flops_profiler.standalone import get_model_profile

__all__ = [
    "FlopsProfiler", "get_model_profile", "get_module_flops", "get_module_macs", "get_module_params",
    "get_module_duration", "number_to_string", "macs_to_string", "flops_to_string", "params_to_string",
    "duration_to_string", "bytes_to_string",
]
