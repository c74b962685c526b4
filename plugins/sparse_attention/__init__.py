"""Sparse attention (DeepSpeed's ``deepspeed.ops.sparse_attention`` and the ``sparse_attention``
config section), for CPU: block-sparse SDDMM / softmax / SpMM kernels in csrc/sparse_attention
(the ``sparse_attn`` native op) with a pure-torch fallback.

* :mod:`.sparsity_config` -- the sparsity structures (``make_layout(seq_len)``)
* :mod:`.layout` -- a layout's CSR / CSC block index, what the kernels read
* :mod:`.kernels` -- the native op or :mod:`.fallback`, and the autograd function
* :mod:`.sparse_self_attention`, :mod:`.bert_sparse_self_attention`,
  :mod:`.sparse_attention_utils` -- DeepSpeed's modules and Hugging Face helpers
* :mod:`.config` -- the section's schema and ``sparsity_config_from_section``
* :mod:`.api` -- the names served at ``dsplug.ops.sparse_attention`` (``dsplug_api_modules``)

The section configures nothing by itself (as in DeepSpeed, the model builds its attention); the
engine method ``engine.sparse_attention_config(num_heads, seed=None)`` returns the
:class:`~.sparsity_config.SparsityConfig` the engine's config describes (None without the
section). Registered by :mod:`.plugin` (entry point ``sparse-attention``).
"""
