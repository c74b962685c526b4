"""SparseAttentionUtils on tiny randomly initialised Hugging Face BERT / RoBERTa models: with a dense
layout the replaced model computes what the original computes (padding masks included, both of
Hugging Face's attention implementations), a sparse layout trains, padding to the block size and
unpadding give the unpadded model's output, and position tables extend by repetition. Skipped
when transformers is not installed."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dsplug.ops.sparse_attention import (  # noqa: E402
    BertSparseSelfAttention,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
)


def tiny(kind: str, attn: str = "eager", max_pos: int = 64):
    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                  attn_implementation=attn)
    torch.manual_seed(0)
    if kind == "bert":
        return transformers.BertModel(transformers.BertConfig(max_position_embeddings=max_pos, **common)).eval()
    config = transformers.RobertaConfig(max_position_embeddings=max_pos + 2, pad_token_id=1, **common)
    return transformers.RobertaModel(config).eval()


def batch(seq=32, pad_from=20):
    ids = torch.randint(3, 50, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, pad_from:] = 0
    return ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_dense_layout_reproduces_the_original_model(kind, attn):
    model = tiny(kind, attn)
    ids, mask = batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    sparse = copy.deepcopy(model)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(sparse, 64,
                                                                               DenseSparsityConfig(2, block=16))
    layers = sparse.encoder.layer
    assert all(isinstance(layer.attention.self, BertSparseSelfAttention) for layer in layers)
    assert layers[0].attention.self.query is not model.encoder.layer[0].attention.self.query  # the copy's own
    with torch.no_grad():
        got = sparse(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :20], want[1, :20], atol=1e-5, rtol=1e-5)  # the padded tail is not compared


def test_replacement_shares_the_trained_projections_and_a_sparse_layout_trains():
    model = transformers.BertForMaskedLM(tiny("bert").config)  # a model with a .bert attribute
    queries = [layer.attention.self.query for layer in model.bert.encoder.layer]
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, FixedSparsityConfig(2, block=8, num_local_blocks=2))
    assert [layer.attention.self.query for layer in model.bert.encoder.layer] == queries
    ids, mask = batch()
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grad = model.bert.encoder.layer[0].attention.self.key.weight.grad
    assert torch.isfinite(loss) and grad is not None and grad.abs().sum() > 0
    sparse_layer = model.bert.encoder.layer[0].attention.self
    dense_layer = BertSparseSelfAttention(model.config, DenseSparsityConfig(2, block=8))
    dense_layer.query, dense_layer.key, dense_layer.value = sparse_layer.query, sparse_layer.key, sparse_layer.value
    hidden = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():  # the fixed layout really drops blocks: its attention differs from full attention
        assert (sparse_layer(hidden)[0] - dense_layer(hidden)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_pad_to_block_size_then_unpad_gives_the_unpadded_output(kind):
    model = tiny(kind)
    ids, mask = batch(seq=21, pad_from=15)
    types = torch.zeros_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(model, 64, DenseSparsityConfig(2, 16))
    pad_token = model.config.pad_token_id
    pad_len, p_ids, p_mask, p_types, p_pos, p_embeds = SparseAttentionUtils.pad_to_block_size(
        16, ids, mask, types, None, None, pad_token, model.embeddings.word_embeddings)
    assert pad_len == 11 and p_ids.shape == (2, 32) and p_pos is None and p_embeds is None
    assert torch.all(p_ids[:, 21:] == pad_token) and torch.all(p_mask[:, 21:] == 0) and torch.all(p_types == 0)
    with torch.no_grad():
        out = model(input_ids=p_ids, attention_mask=p_mask, token_type_ids=p_types).last_hidden_state
    got = SparseAttentionUtils.unpad_sequence_output(pad_len, out)
    assert got.shape == want.shape
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :15], want[1, :15], atol=1e-5, rtol=1e-5)


def test_pad_to_block_size_pads_embeddings_and_makes_a_mask():
    embed = torch.nn.Embedding(10, 4)
    embeds = torch.randn(2, 5, 4)
    pad_len, ids, mask, types, pos, out = SparseAttentionUtils.pad_to_block_size(
        8, None, None, None, torch.arange(5).expand(2, 5), embeds, 0, embed)
    assert pad_len == 3 and ids is None and types is None
    assert torch.equal(out[:, :5], embeds) and torch.equal(out[:, 5:], embed(torch.zeros(2, 3, dtype=torch.long)))
    assert mask.tolist() == [[1] * 5 + [0] * 3] * 2 and pos[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    same = SparseAttentionUtils.pad_to_block_size(5, None, None, None, None, embeds, 0, embed)
    assert same[0] == 0 and same[5] is embeds
    with pytest.raises(ValueError, match="needs input_ids or inputs_embeds"):
        SparseAttentionUtils.pad_to_block_size(8, None, None, None, None, None, 0, embed)


def test_extend_position_embedding_repeats_the_trained_table():
    bert = tiny("bert")
    old = bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(bert, 150)
    new = bert.embeddings.position_embeddings.weight
    assert new.shape == (150, 32) and bert.config.max_position_embeddings == 150
    assert torch.equal(new[:64], old) and torch.equal(new[64:128], old) and torch.equal(new[128:], old[:22])
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(bert, 150, FixedSparsityConfig(2, 16))
    ids = torch.randint(3, 50, (1, 144))
    with torch.no_grad():
        assert bert(input_ids=ids).last_hidden_state.shape == (1, 144, 32)  # longer than the original 64

    roberta = tiny("roberta")
    old = roberta.embeddings.position_embeddings.weight.detach().clone()  # 2 reserved rows + 64 positions
    SparseAttentionUtils.extend_position_embedding(roberta, 100)
    new = roberta.embeddings.position_embeddings.weight
    assert new.shape == (102, 32) and roberta.config.max_position_embeddings == 102
    assert torch.equal(new[:66], old) and torch.equal(new[66:], old[2:38])
    with pytest.raises(ValueError, match="must be an int larger than the model's 64 positions"):
        SparseAttentionUtils.extend_position_embedding(tiny("bert"), 64)
    with pytest.raises(ValueError, match="not a BERT or RoBERTa model"):
        SparseAttentionUtils.extend_position_embedding(torch.nn.Linear(2, 2), 100)


def test_update_tokenizer_model_max_length():
    tokenizer = SimpleNamespace(model_max_length=512, init_kwargs={"model_max_length": 512})
    assert SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 4096) is tokenizer
    assert tokenizer.model_max_length == 4096 and tokenizer.init_kwargs["model_max_length"] == 4096


def test_bert_layer_alone_and_its_errors():
    config = tiny("bert").config
    layer = BertSparseSelfAttention(config, DenseSparsityConfig(2, 16))
    hidden = torch.randn(2, 32, 32)
    extended = torch.zeros(2, 1, 1, 32)
    extended[1, ..., 20:] = -10000.0  # BERT's extended additive mask
    out = layer(hidden, extended)
    assert out.shape == (2, 32, 32)  # DeepSpeed's layer returns the context tensor
    causal = torch.zeros(2, 1, 32, 32).masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), -1e4)
    with pytest.raises(ValueError, match="differs between query positions"):
        layer(hidden, causal)
    with pytest.raises(ValueError, match="does not support cross-attention"):
        layer(hidden, extended, encoder_hidden_states=hidden)
    with pytest.raises(ValueError, match="sparsity_config has num_heads=4 but the model has num_attention_heads=2"):
        BertSparseSelfAttention(config, FixedSparsityConfig(4))
