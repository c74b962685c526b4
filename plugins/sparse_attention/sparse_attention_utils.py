"""``SparseAttentionUtils``: adapting a pre-trained Hugging Face BERT / RoBERTa model to sparse
attention (DeepSpeed's helper class and its static methods).

* ``extend_position_embedding(model, max_position)``: a longer position table, initialised by
  repeating the trained one (DeepSpeed's recipe: it converges much faster than a fresh table).
  BERT: rows ``i`` of the new table copy row ``i % P`` of the old (``P`` rows). RoBERTa reserves
  the first two rows (padding): they are kept, and the ``P - 2`` position rows repeat after them,
  for ``max_position + 2`` rows. The embeddings' ``position_ids`` / ``token_type_ids`` buffers and
  ``config.max_position_embeddings`` follow. (DeepSpeed's version rounds ``max_position`` down to a
  multiple of the old size and leaves RoBERTa's two reserved rows uninitialised; here the table
  has exactly the requested positions.)
* ``update_tokenizer_model_max_length(tokenizer, max_position)``.
* ``replace_model_self_attention_with_sparse_self_attention(model, max_position, sparsity_config)``
  and ``replace_self_attention_layer_with_sparse_self_attention_layer(config, layers,
  sparsity_config)``: each layer's ``attention.self`` becomes a
  :class:`~.bert_sparse_self_attention.BertSparseSelfAttention` sharing the trained query / key /
  value projections. A model is a ``BertModel`` / ``RobertaModel`` or any model with a ``bert`` /
  ``roberta`` attribute (``BertForMaskedLM`` ...).
* ``pad_to_block_size(block_size, input_ids, attention_mask, token_type_ids, position_ids,
  inputs_embeds, pad_token_id, model_embeddings)`` and ``unpad_sequence_output(pad_len,
  sequence_output)``: sequences must be a multiple of the block size.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .bert_sparse_self_attention import BertSparseSelfAttention
from .sparsity_config import FixedSparsityConfig, SparsityConfig

__all__ = ["SparseAttentionUtils"]


def _backbone(model: nn.Module) -> Tuple[nn.Module, str]:
    """(the module holding ``embeddings`` and ``encoder``, "bert" or "roberta")."""
    for kind in ("bert", "roberta"):
        inner = getattr(model, kind, None)
        if isinstance(inner, nn.Module):
            return inner, kind
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in ("bert", "roberta") and hasattr(model, "embeddings") and hasattr(model, "encoder"):
        return model, kind
    raise ValueError(f"{type(model).__name__} is not a BERT or RoBERTa model (no 'bert' / 'roberta' attribute and "
                     f"config.model_type={kind!r}); only BERT and RoBERTa models are supported")


class SparseAttentionUtils:
    """Static helpers to run a pre-trained BERT / RoBERTa with sparse self-attention."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        backbone, kind = _backbone(model)
        embeddings = backbone.embeddings
        table = embeddings.position_embeddings
        old = table.weight.data
        reserved = 2 if kind == "roberta" else 0  # RoBERTa: rows 0, 1 belong to padding
        original = old.shape[0] - reserved
        if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= original:
            raise ValueError(f"max_position={max_position!r} must be an int larger than the model's "
                             f"{original} positions")
        repeats = -(-max_position // original)
        new = torch.cat([old[:reserved], old[reserved:].repeat(repeats, 1)[:max_position]], dim=0)
        table.weight.data = new.contiguous()
        table.num_embeddings = new.shape[0]
        size = new.shape[0]
        device = new.device
        if isinstance(getattr(embeddings, "position_ids", None), torch.Tensor):
            embeddings.position_ids = torch.arange(size, device=device).expand(1, -1).clone()
        if isinstance(getattr(embeddings, "token_type_ids", None), torch.Tensor):
            embeddings.token_type_ids = torch.zeros((1, size), dtype=torch.long, device=device)
        model.config.max_position_embeddings = size
        if model.config is not getattr(backbone, "config", model.config):
            backbone.config.max_position_embeddings = size
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position: int):
        tokenizer.model_max_length = max_position
        init_kwargs = getattr(tokenizer, "init_kwargs", None)
        if isinstance(init_kwargs, dict):
            init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(model: nn.Module, max_position: int,
                                                                sparsity_config: Optional[SparsityConfig] = None):
        backbone, kind = _backbone(model)
        config = model.config
        config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            config, backbone.encoder.layer, sparsity_config, max_seq_length=max_position)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(config, layers,
                                                                      sparsity_config: Optional[SparsityConfig] = None,
                                                                      *, max_seq_length: Optional[int] = None):
        """Each layer's ``attention.self`` becomes a :class:`BertSparseSelfAttention` holding the same
        query / key / value modules (``sparsity_config`` default:
        ``FixedSparsityConfig(num_heads=config.num_attention_heads)``)."""
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=int(config.num_attention_heads))
        if max_seq_length is not None:
            block = sparsity_config.block
            max_seq_length = -(-int(max_seq_length) // block) * block
        outputs = None
        for layer in layers:
            original = layer.attention.self
            if isinstance(original, BertSparseSelfAttention):
                raise ValueError("this layer's self-attention is already a BertSparseSelfAttention")
            if outputs is None:
                outputs = _result_arity(original, config)
            sparse = BertSparseSelfAttention(config, sparsity_config, max_seq_length=max_seq_length)
            sparse.query, sparse.key, sparse.value = original.query, original.key, original.value
            sparse.hf_outputs = outputs
            sparse.train(original.training)
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                          token_type_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                          inputs_embeds: Optional[torch.Tensor], pad_token_id: int, model_embeddings=None):
        """Pad the sequence dimension to a multiple of ``block_size``. Returns ``(pad_len,
        input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``.

        ``input_ids`` / ``position_ids`` get ``pad_token_id``, ``token_type_ids`` 0, the
        ``[batch, seq]`` ``attention_mask`` 0 (False) so the padding is not attended to (one is
        made when it is None and padding is needed); ``inputs_embeds`` gets
        ``model_embeddings(pad ids)`` (the module mapping ids to input embeddings, e.g. the word
        embeddings)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if input_ids is not None:
            batch, seq = input_ids.shape[:2]
            device = input_ids.device
        elif inputs_embeds is not None:
            batch, seq = inputs_embeds.shape[:2]
            device = inputs_embeds.device
        else:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len == 0:
            return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("padding inputs_embeds needs model_embeddings (the module embedding token ids)")
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids).to(inputs_embeds.dtype)], dim=-2)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is None:
            attention_mask = torch.ones((batch, seq), dtype=torch.long, device=device)
        attention_mask = F.pad(attention_mask, (0, pad_len), value=False if attention_mask.dtype == torch.bool else 0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the ``pad_len`` positions :meth:`pad_to_block_size` added (sequence dimension 1)."""
        if pad_len > 0:
            sequence_output = sequence_output[:, :-pad_len]
        return sequence_output


def _result_arity(layer: nn.Module, config) -> Optional[int]:
    """How many items the Hugging Face self-attention layer returns (None: a bare tensor), found by
    calling it once on one token (results differ between transformers versions)."""
    param = next(layer.parameters(), None)
    hidden = torch.zeros((1, 1, int(config.hidden_size)), dtype=param.dtype if param is not None else torch.float32,
                         device=param.device if param is not None else "cpu")
    with torch.no_grad():
        result = layer(hidden)
    if isinstance(result, torch.Tensor):
        return None
    return len(result)
