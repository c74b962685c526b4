"""``dsplug.ops.sparse_attention``: DeepSpeed's ``deepspeed.ops.sparse_attention`` (sparsity
configs, ``SparseSelfAttention``, ``BertSparseSelfAttention``, ``SparseAttentionUtils``) on CPU.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: ``dsplug.plugins.sparse_attention.api``); they are
resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
