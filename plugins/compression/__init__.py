"""Compression-method plugins: the seven entries of ``compression_training``.

Each method is a spec of its own, registered by :mod:`.plugin` (which imports no torch), and is
selected by its key:

* :mod:`.layer_reduction` -- ``layer_reduction``: a shallower student from chosen teacher layers
* :mod:`.weight_quantization` -- ``weight_quantization``: quantization-aware training of weights
* :mod:`.activation_quantization` -- ``activation_quantization``: quantized layer inputs
* :mod:`.sparse_pruning` -- ``sparse_pruning``: l1 / topk / snip_momentum weight sparsity
* :mod:`.row_pruning`, :mod:`.head_pruning`, :mod:`.channel_pruning` -- structured pruning with
  physical removal by ``redundancy_clean``

Shared pieces: :mod:`.layers` (the compressed Linear / Conv2d layer), :mod:`.selection` (name
patterns), :mod:`.method` and :mod:`.pruning` (schedules, state), :mod:`.masks`
(the mask math; quantization is the kernel's :mod:`dsplug.ops.quantize`, a native op), :mod:`.shrink` (physical
removal), :mod:`.api` (``init_compression`` / ``redundancy_clean``, DeepSpeed's
``deepspeed.compression.compress``).
"""
