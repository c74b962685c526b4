"""Utilities under DeepSpeed's ``deepspeed.utils`` paths (``dsplug.utils.zero_to_fp32``)."""
