"""The partitioned ZeRO checkpoint format (``docs/zero-stages.md``), shared by every stage.

* :mod:`.layout`            where each parameter's elements sit in the ranks' partitions; merging
* :mod:`.deepspeed_format`  DeepSpeed's keys and files, read and written alongside dsplug's own
* :mod:`.zero_to_fp32`      offline consolidation into one fp32 state dict (``dsplug zero-to-fp32``)
* :mod:`.zero_to_fp32_script` the standalone script copied next to each checkpoint, as DeepSpeed does

Imports go one way: layout <- deepspeed_format <- zero_to_fp32.
"""
