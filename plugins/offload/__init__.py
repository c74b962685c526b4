"""Offload devices (``zero_optimization.offload_param.device`` / ``offload_optimizer.device``):
``none``, ``cpu`` and ``nvme`` — ZeRO-Offload and ZeRO-Infinity.

Registered by :mod:`.plugin` (category ``offload_device``; the ``nvme`` plugin also owns the
top-level ``aio`` section). What each device does, and the seams in the ZeRO stages it fills, is
described in ``docs/offload.md``. Modules:

* :mod:`.devices`    the objects the plugins' factories return (what a ZeRO stage asks of a device)
* :mod:`.zero3`      stage 3 partitions with offloaded master weights / optimizer states
* :mod:`.params`     stage 3 parameter partitions in host memory or in swap files
* :mod:`.zero12`     stages 1 and 2 with the optimizer step on the CPU
* :mod:`.host_optimizer`  which optimizer steps on the CPU (``zero_force_ds_cpu_optimizer``), and the
  optimizer that splits one step between the CPU and the accelerator (``ratio``)
* :mod:`.swap`       private swap directories, space checks, checked aio reads and writes, buffer pools
"""
