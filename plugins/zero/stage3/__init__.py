"""ZeRO stage 3 (``zero_optimization.stage: 3``): parameters, gradients and optimizer states
partitioned over the data-parallel ranks. Registered by :mod:`.plugin`; the public API for
models (``Init``, ``GatheredParameters``) is :mod:`.api`, importable as ``dsplug.zero``."""
