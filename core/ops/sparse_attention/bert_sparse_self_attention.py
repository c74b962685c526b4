"""``deepspeed.ops.sparse_attention.bert_sparse_self_attention``: its names come from the sparse attention plugin
(``dsplug_api_modules``), resolved on first use (see :mod:`dsplug.public`)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
