"""The names of ``dsplug.ops.sparse_attention`` (DeepSpeed's ``deepspeed.ops.sparse_attention``).

DeepSpeed's public classes -- the sparsity configs, ``SparseSelfAttention``,
``BertSparseSelfAttention``, ``SparseAttentionUtils`` -- plus dsplug's functional kernels
(``block_sparse_attention``, ``sdd_matmul``, ``dsd_matmul``, ``sparse_softmax``,
``sparse_softmax_backward``), ``BlockLayout`` and the config helper
``sparsity_config_from_section``.
"""
from .bert_sparse_self_attention import BertSparseSelfAttention
from .config import sparsity_config_from_section
from .kernels import (
    backend,
    block_sparse_attention,
    dsd_matmul,
    native_available,
    sdd_matmul,
    sparse_softmax,
    sparse_softmax_backward,
)
from .layout import BlockLayout
from .sparse_attention_utils import SparseAttentionUtils
from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    SparsityConfigError,
    VariableSparsityConfig,
)

__all__ = [
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparsityConfigError", "SparseSelfAttention",
    "BertSparseSelfAttention", "SparseAttentionUtils", "BlockLayout", "block_sparse_attention", "sdd_matmul",
    "dsd_matmul", "sparse_softmax", "sparse_softmax_backward", "native_available", "backend",
    "sparsity_config_from_section",
]
