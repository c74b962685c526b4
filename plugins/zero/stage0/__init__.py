"""ZeRO stage 0 (``zero_optimization.stage: 0``): plain data parallelism, gradients all-reduced
in buckets overlapped with backward. Registered by :mod:`.plugin`; the stage is :mod:`.stage`."""
