"""Offload devices (``zero_optimization.offload_param.device`` / ``offload_optimizer.device``):
``none``, ``cpu`` and ``nvme`` — the storage behind ZeRO-Offload and ZeRO-Infinity.

Registered by :mod:`.plugin` (category ``offload_device``; the ``nvme`` plugin also owns the
top-level ``aio`` section). Each device is a storage service
(:class:`dsplug.contracts.OffloadDevice`: allocate, read, write, prefetch, free) that knows no
ZeRO stage; the stages decide what to keep there (``plugins/zero``). Modules:

* :mod:`.devices`    the three devices
* :mod:`.swap`       ``nvme``'s private swap directories, space checks, checked aio reads and writes
* :mod:`.config`     the ``aio`` section and ``nvme``'s config rule
* :mod:`.nvme_tune`  ``dsplug nvme-tune``
"""
