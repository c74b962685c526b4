"""DeepSpeed's import path ``deepspeed.utils.zero_to_fp32``: see :mod:`dsplug.zero_to_fp32`."""
from dsplug.zero_to_fp32 import (  # noqa: F401
    MergedGroup,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    merge_partitions,
    param_pieces,
)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "merge_partitions", "param_pieces", "MergedGroup"]
