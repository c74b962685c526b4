"""``BertSparseSelfAttention``: a BERT self-attention layer whose attention is block-sparse.

DeepSpeed's module: ``query`` / ``key`` / ``value`` projections of ``config.hidden_size`` and a
:class:`~.sparse_self_attention.SparseSelfAttention`; ``forward(hidden_states, attention_mask)``
returns the context ``[batch, seq_len, hidden_size]``. ``attention_mask`` is the layer's key
padding mask: the extended additive mask ``[batch, 1, 1, seq_len]`` (0 to attend, a large negative
number to mask) that BERT hands its layers, or a bool mask (True = attend). Masks expanded per
query (``[batch, 1, seq_len, seq_len]``, as recent Hugging Face versions build them) are accepted
when every query row is the same (padding); a mask that differs per query (causal, per-token) is
refused with an error, as the layer only applies key padding. There is no attention dropout
(DeepSpeed's layer has none either).

:func:`~.sparse_attention_utils.SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer`
installs it in a Hugging Face BERT / RoBERTa model; it then also answers Hugging Face's calling
convention (extra keyword arguments, a tuple as result).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import FixedSparsityConfig, SparsityConfig

__all__ = ["BertSparseSelfAttention"]

# positional arguments after attention_mask in Hugging Face 4.x's BertSelfAttention.forward
_HF4_POSITIONAL = ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value",
                   "output_attentions")
_REFUSED = {
    "head_mask": "a head mask",
    "encoder_hidden_states": "cross-attention (encoder_hidden_states)",
    "encoder_attention_mask": "cross-attention (encoder_attention_mask)",
    "past_key_value": "cached keys and values (past_key_value)",
    "past_key_values": "cached keys and values (past_key_values)",
    "output_attentions": "returning attention probabilities (output_attentions)",
}


class BertSparseSelfAttention(nn.Module):
    """Sparse BERT self-attention. ``config``: any object with ``hidden_size`` and
    ``num_attention_heads`` (a Hugging Face ``BertConfig``); ``sparsity_config``: default
    ``FixedSparsityConfig(num_heads=config.num_attention_heads)``; ``max_seq_length``: the longest
    sequence (default: ``config.max_position_embeddings`` rounded up to a block multiple, at
    least 2048 as DeepSpeed's layer)."""

    def __init__(self, config, sparsity_config: Optional[SparsityConfig] = None, *,
                 max_seq_length: Optional[int] = None, backend: Optional[str] = None):
        super().__init__()
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        if hidden % heads:
            raise ValueError(f"The hidden size ({hidden}) is not a multiple of the number of attention heads ({heads})")
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=heads)
        if sparsity_config.num_heads != heads:
            raise ValueError(f"sparsity_config has num_heads={sparsity_config.num_heads} but the model has "
                             f"num_attention_heads={heads}")
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        if max_seq_length is None:
            block = sparsity_config.block
            longest = max(2048, int(getattr(config, "max_position_embeddings", 0) or 0))
            max_seq_length = -(-longest // block) * block
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length,
                                                         backend=backend)
        #: None: forward returns the context tensor (DeepSpeed). An int n: a tuple of n items, the
        #: context then None (the result shape of the Hugging Face layer it replaced).
        self.hf_outputs: Optional[int] = None

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden]`` -> ``[batch, heads, seq, head_size]``."""
        x = x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def _key_padding(self, mask: Optional[torch.Tensor], seq_len: int) -> Optional[torch.Tensor]:
        if mask is None:
            return None
        if mask.dim() == 4 and mask.shape[-2] > 1:
            if not bool((mask == mask[..., :1, :]).all()):
                raise ValueError("BertSparseSelfAttention applies a key padding mask only; this attention_mask "
                                 f"(shape {tuple(mask.shape)}) differs between query positions (causal or "
                                 "per-token masking), which it cannot apply")
            mask = mask[..., :1, :]
        return mask

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *args, **kwargs):
        for name, value in list(zip(_HF4_POSITIONAL, args)) + list(kwargs.items()):
            if name in _REFUSED and value is not None and value is not False:
                raise ValueError(f"BertSparseSelfAttention does not support {_REFUSED[name]}")
        if len(args) > len(_HF4_POSITIONAL):
            raise TypeError(f"BertSparseSelfAttention.forward got {2 + len(args)} positional arguments")
        query = self.transpose_for_scores(self.query(hidden_states))
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(query, key, value,
                                             key_padding_mask=self._key_padding(attention_mask, query.shape[2]))
        context = context.permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.shape[:-2], self.all_head_size)
        if self.hf_outputs is None:
            return context
        return (context,) + (None,) * (self.hf_outputs - 1)
