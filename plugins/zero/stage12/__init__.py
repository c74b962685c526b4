"""ZeRO stages 1 and 2 (``zero_optimization.stage: 1`` / ``2``): optimizer states, fp32 master
weights (and at stage 2 gradients) partitioned in flat per-group buffers. Registered by
:mod:`.plugin`; the stage is :mod:`.stage`, its gradient reduction :mod:`.reducer`, its optimizer
offload :mod:`.offload`."""
