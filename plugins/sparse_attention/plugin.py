"""Registers sparse attention: the ``sparse_attention`` section, DeepSpeed's
``deepspeed.ops.sparse_attention`` import paths (:mod:`.api`) and the engine method
``engine.sparse_attention_config(num_heads, seed=None)``.

Entry point: ``sparse-attention = "dsplug.plugins.sparse_attention.plugin"``. Importing this
module is cheap (no torch).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import SparseAttentionConfig, warn_unused_keys

SECTION = "sparse_attention"
API = "dsplug.plugins.sparse_attention.api"
#: DeepSpeed's submodules of deepspeed.ops.sparse_attention, all served by the api module
SUBMODULES = ("sparsity_config", "sparse_self_attention", "bert_sparse_self_attention", "sparse_attention_utils")


@hookimpl
def dsplug_config_sections():
    return [
        PluginSpec(
            category="section",
            name=SECTION,
            section=SECTION,
            schema=SparseAttentionConfig,
            rules=(warn_unused_keys,),
            ops=("sparse_attn",),
            summary="sparse attention layouts (dense / fixed / variable / bigbird / bslongformer) for "
                    "dsplug.ops.sparse_attention; engine.sparse_attention_config(num_heads)",
        )
    ]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.ops.sparse_attention", API)] + [
        ApiModule(f"dsplug.ops.sparse_attention.{name}", API) for name in SUBMODULES
    ]


@hookimpl
def dsplug_engine_methods(engine):
    """``engine.sparse_attention_config(num_heads, seed=None)``: the sparsity config of the
    engine's ``sparse_attention`` section for a layer of ``num_heads`` heads, or None when the
    config has no such section."""
    config = engine.config

    def sparse_attention_config(num_heads: int, seed=None):
        if SECTION not in config.sections:
            return None
        from .config import sparsity_config_from_section

        return sparsity_config_from_section(config.sections[SECTION], num_heads, seed=seed)

    return {"sparse_attention_config": sparse_attention_config}
