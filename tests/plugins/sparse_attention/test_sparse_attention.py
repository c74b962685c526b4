"""Sparse attention: the sparsity configs' layouts against hand-written expectations, their
errors, random blocks from a seed, the ``sparse_attention`` config section, the engine method,
DeepSpeed's import paths, and the ``SparseSelfAttention`` module (layout slicing, causal
configs, masks, state, the layout broadcast over 2 real processes)."""
from __future__ import annotations

import importlib
import random
import sys
import warnings

import pytest
import torch

import dsplug
from dsplug.config import ConfigError, DsplugConfig, DsplugConfigWarning
from dsplug.plugins.sparse_attention.config import MODE_KEYS, sparsity_config_from_section
from dsplug.plugins.sparse_attention.sparse_self_attention import SparseSelfAttention
from dsplug.plugins.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    SparsityConfigError,
    VariableSparsityConfig,
)
from dsplug.testing import SectionContract, tiny_engine

from tests.dist_harness import run_distributed


def T(rows):
    return torch.tensor(rows, dtype=torch.int64)


def head0(cfg, seq_len):
    layout = cfg.make_layout(seq_len)
    assert layout.dtype == torch.int64 and layout.shape == (cfg.num_heads, seq_len // cfg.block, seq_len // cfg.block)
    return layout[0]


# --------------------------------------------------------------------------- layouts by hand
def test_dense_layout_is_all_ones():
    layout = DenseSparsityConfig(3, block=8).make_layout(40)
    assert layout.shape == (3, 5, 5) and torch.all(layout == 1)


def test_fixed_bidirectional_local_windows_and_last_block_global():
    a, b = [1, 1, 1, 1, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1, 1, 1]
    assert torch.equal(head0(FixedSparsityConfig(2, block=16), 128), T([a] * 4 + [b] * 4))


def test_fixed_unidirectional_keeps_the_lower_triangle_of_windows_and_globals_from_their_row():
    want = T([[1, 0, 0, 0, 0, 0, 0, 0],
              [1, 1, 0, 0, 0, 0, 0, 0],
              [1, 1, 1, 0, 0, 0, 0, 0],
              [1, 1, 1, 1, 0, 0, 0, 0],
              [0, 0, 0, 1, 1, 0, 0, 0],
              [0, 0, 0, 1, 1, 1, 0, 0],
              [0, 0, 0, 1, 1, 1, 1, 0],
              [0, 0, 0, 1, 1, 1, 1, 1]])
    assert torch.equal(head0(FixedSparsityConfig(1, block=4, attention="unidirectional"), 32), want)


def test_fixed_global_patterns_differ_per_head():
    layout = FixedSparsityConfig(3, 16, True, num_different_global_patterns=2).make_layout(128)
    assert torch.equal(layout[0, 0], T([1, 1, 1, 1, 0, 0, 0, 1]))  # head 0: last block of each window
    assert torch.equal(layout[1, 0], T([1, 1, 1, 1, 0, 0, 1, 0]))  # head 1: the one before
    assert torch.equal(layout[1, 4], T([0, 0, 1, 0, 1, 1, 1, 1]))
    assert torch.equal(layout[2], layout[0])  # patterns cycle over the heads


def test_fixed_horizontal_global_attention_and_short_last_window():
    want = T([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(head0(FixedSparsityConfig(1, 16, num_local_blocks=2, horizontal_global_attention=True), 64),
                       want)
    # windows [0, 4) and a short [4, 6): its global block is the last one that fits
    a, b = [1, 1, 1, 1, 0, 1], [0, 0, 0, 1, 1, 1]
    assert torch.equal(head0(FixedSparsityConfig(1, 16), 96), T([a] * 4 + [b] * 2))


def test_variable_windows_of_given_sizes_and_global_blocks():
    want = T([[1, 0, 0, 0, 0, 0],
              [1, 1, 1, 0, 0, 0],
              [1, 1, 1, 0, 0, 0],
              [1, 0, 0, 1, 1, 0],
              [1, 0, 0, 1, 1, 0],
              [1, 0, 0, 0, 0, 1]])
    assert torch.equal(head0(VariableSparsityConfig(1, 16, local_window_blocks=[1, 2]), 96), want)
    ranged = VariableSparsityConfig(1, 16, local_window_blocks=[2], global_block_indices=[1],
                                    global_block_end_indices=[3], horizontal_global_attention=True)
    assert torch.equal(head0(ranged, 80), T([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0],
                                             [0, 1, 1, 0, 1]]))
    causal = VariableSparsityConfig(1, 16, local_window_blocks=[2], global_block_indices=[2],
                                    attention="unidirectional")
    assert torch.equal(head0(causal, 80), T([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                             [0, 0, 1, 0, 1]]))
    # a global index beyond the sequence is skipped (the layout may be made for a shorter one)
    assert torch.equal(head0(VariableSparsityConfig(1, 16, global_block_indices=[0, 9]), 64)[:, 0], T([1] * 4))


def test_bigbird_sliding_window_and_global_blocks():
    want = T([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 0, 0, 1, 1]])
    assert torch.equal(head0(BigBirdSparsityConfig(1, 16, num_random_blocks=0), 80), want)
    uni = BigBirdSparsityConfig(1, 16, num_random_blocks=0, attention="unidirectional")
    assert torch.equal(head0(uni, 80), want.tril())


def test_bslongformer_sliding_window_and_global_indices_or_ranges():
    want = T([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert torch.equal(head0(BSLongformerSparsityConfig(1, 16, global_block_indices=[2]), 80), want)
    ranged = BSLongformerSparsityConfig(1, 16, num_sliding_window_blocks=1, global_block_indices=[0],
                                        global_block_end_indices=[2])
    want = T([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]])
    assert torch.equal(head0(ranged, 80), want)
    uni = BSLongformerSparsityConfig(1, 16, num_sliding_window_blocks=1, global_block_indices=[0],
                                     global_block_end_indices=[2], attention="unidirectional")
    assert torch.equal(head0(uni, 80), want.tril())


def test_local_sliding_window():
    assert torch.equal(head0(LocalSlidingWindowSparsityConfig(1, 8), 32),
                       T([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]))
    assert torch.equal(head0(LocalSlidingWindowSparsityConfig(1, 8, attention="bidirectional"), 32),
                       T([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]))


# --------------------------------------------------------------------------- random blocks
def test_random_blocks_are_reproducible_from_a_seed_or_the_global_state():
    def make(**kw):
        return BigBirdSparsityConfig(4, 16, True, num_random_blocks=3, num_sliding_window_blocks=1, **kw)

    a, b, c = make(seed=7).make_layout(1024), make(seed=7).make_layout(1024), make(seed=8).make_layout(1024)
    assert torch.equal(a, b) and not torch.equal(a, c)
    random.seed(11)
    d = make().make_layout(1024)
    random.seed(11)
    assert torch.equal(d, make().make_layout(1024))
    assert not torch.equal(a[0], a[1])  # different_layout_per_head: each head draws its own
    nb = 64
    for layout in (a, d):
        for h in range(4):
            for r in range(1, nb):
                extra = set(layout[h, r].nonzero().flatten().tolist()) - {0, r}
                assert len(extra) <= 3  # at most num_random_blocks beyond the window and the global block
    shared = VariableSparsityConfig(3, 16, num_random_blocks=2, seed=1).make_layout(512)
    assert torch.equal(shared[0], shared[1]) and torch.equal(shared[0], shared[2])


def test_unidirectional_bigbird_draws_only_past_blocks():
    layout = BigBirdSparsityConfig(1, 16, num_random_blocks=4, num_sliding_window_blocks=1, seed=0,
                                   attention="unidirectional").make_layout(512)
    assert torch.equal(layout, layout.tril())
    assert torch.all(layout[0].sum(-1) >= torch.minimum(torch.arange(1, 33), torch.tensor(4)))


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make,key,words", [
    (lambda: FixedSparsityConfig(4, num_local_blocks=3, num_global_blocks=2), "num_global_blocks",
     "num_local_blocks=3 must be a multiple of num_global_blocks=2"),
    (lambda: FixedSparsityConfig(4, attention="causal"), "attention", "attention='causal' is not valid"),
    (lambda: FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True),
     "horizontal_global_attention", "needs attention='bidirectional'"),
    (lambda: FixedSparsityConfig(4, num_different_global_patterns=2), "num_different_global_patterns",
     "needs different_layout_per_head=True"),
    (lambda: FixedSparsityConfig(4, different_layout_per_head=True, num_different_global_patterns=5),
     "num_different_global_patterns", "exceeds num_local_blocks / num_global_blocks = 4 / 1 = 4"),
    (lambda: VariableSparsityConfig(4, global_block_indices=[0, 3], global_block_end_indices=[2]),
     "global_block_end_indices", "has 1 entries but global_block_indices has 2"),
    (lambda: BSLongformerSparsityConfig(4, global_block_indices=[3], global_block_end_indices=[3]),
     "global_block_end_indices", "global_block_indices[0]=3 must be smaller than global_block_end_indices[0]=3"),
    (lambda: SparsityConfig(0), "num_heads", "num_heads=0 is not valid"),
    (lambda: DenseSparsityConfig(2, block=2.5), "block", "block must be an int"),
])
def test_invalid_settings_name_the_argument(make, key, words):
    with pytest.raises(SparsityConfigError) as err:
        make()
    assert err.value.key == key and words in str(err.value)


def test_layout_errors():
    with pytest.raises(ValueError, match="seq_len=100 is not a multiple of block=16"):
        FixedSparsityConfig(2).make_layout(100)
    with pytest.raises(SparsityConfigError, match="num_random_blocks=5 exceeds the 4 blocks of a row"):
        BigBirdSparsityConfig(2, num_random_blocks=5).make_layout(64)
    with pytest.raises(SparsityConfigError, match="num_sliding_window_blocks=7 exceeds the 4 blocks"):
        BSLongformerSparsityConfig(2, num_sliding_window_blocks=7).make_layout(64)
    with pytest.raises(SparsityConfigError, match="num_global_blocks=5 exceeds"):
        BigBirdSparsityConfig(2, num_random_blocks=0, num_global_blocks=5, num_sliding_window_blocks=1).make_layout(64)
    with pytest.raises(TypeError, match="SparsityConfig defines no sparsity pattern"):
        SparsityConfig(2).make_layout(64)


# --------------------------------------------------------------------------- config section
DOCUMENTED = {  # DeepSpeed's reference lists every key with mode "fixed"
    "mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4, "num_global_blocks": 1,
    "attention": "bidirectional", "horizontal_global_attention": False, "num_different_global_patterns": 4,
    "num_random_blocks": 0, "local_window_blocks": [4], "global_block_indices": [0], "global_block_end_indices": None,
    "num_sliding_window_blocks": 3,
}


def parsed(section):
    return DsplugConfig({"train_batch_size": 1, "sparse_attention": section}, world_size=1)


def test_documented_example_parses_and_unused_keys_are_reported_not_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parsed(DOCUMENTED)
    notes = sorted(str(w.message) for w in caught if issubclass(w.category, DsplugConfigWarning))
    assert notes == [
        "sparse_attention.global_block_indices: has no effect with mode 'fixed'; it is used by mode variable, "
        "bslongformer",
        "sparse_attention.local_window_blocks: has no effect with mode 'fixed'; it is used by mode variable",
        "sparse_attention.num_random_blocks: has no effect with mode 'fixed'; it is used by mode variable, bigbird",
        "sparse_attention.num_sliding_window_blocks: has no effect with mode 'fixed'; it is used by mode bigbird, "
        "bslongformer",
    ]
    cfg = sparsity_config_from_section(config.section("sparse_attention"), num_heads=8)
    assert isinstance(cfg, FixedSparsityConfig)
    assert (cfg.num_heads, cfg.block, cfg.different_layout_per_head, cfg.num_local_blocks, cfg.num_global_blocks,
            cfg.attention, cfg.horizontal_global_attention, cfg.num_different_global_patterns) == \
        (8, 16, True, 4, 1, "bidirectional", False, 4)


def test_each_mode_builds_its_class_with_deepspeeds_defaults():
    expected = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
                "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig}
    for mode, cls in expected.items():
        cfg = sparsity_config_from_section(parsed({"mode": mode}).section("sparse_attention"), num_heads=4)
        assert type(cfg) is cls and cfg.block == 16 and cfg.different_layout_per_head is False
        for key, default in MODE_KEYS[mode].items():
            assert getattr(cfg, key) == default, (mode, key)
    section = parsed({"mode": "bigbird"}).section("sparse_attention")  # the mode's defaults are filled in
    assert (section.num_sliding_window_blocks, section.num_global_blocks, section.num_random_blocks,
            section.attention, section.num_local_blocks, section.local_window_blocks) == (3, 1, 0, "bidirectional",
                                                                                         None, None)
    default = sparsity_config_from_section(parsed({}).section("sparse_attention"), num_heads=2)
    assert type(default) is FixedSparsityConfig  # mode defaults to fixed
    cfg = sparsity_config_from_section({"mode": "bigbird", "block": 32, "num_random_blocks": 2, "attention":
                                        "unidirectional"}, num_heads=2, seed=3)
    assert (cfg.block, cfg.num_random_blocks, cfg.attention, cfg.seed) == (32, 2, "unidirectional", 3)


@pytest.mark.parametrize("section,path,words", [
    ({"mode": "fixd"}, "sparse_attention.mode", "did you mean 'fixed'"),
    ({"blok": 16}, "sparse_attention.blok", "unknown key; did you mean 'sparse_attention.block'"),
    ({"block": 0}, "sparse_attention.block", "must be >= 1"),
    ({"num_local_blocks": 3, "num_global_blocks": 2}, "sparse_attention.num_global_blocks",
     "must be a multiple of num_global_blocks=2"),
    ({"num_different_global_patterns": 2}, "sparse_attention.num_different_global_patterns",
     "needs different_layout_per_head=True"),
    ({"mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True},
     "sparse_attention.horizontal_global_attention", "needs attention='bidirectional'"),
    ({"mode": "bslongformer", "global_block_indices": [0, 4], "global_block_end_indices": [2]},
     "sparse_attention.global_block_end_indices", "pair up as [start, end) ranges"),
    ({"attention": "causal"}, "sparse_attention.attention", "must be one of 'bidirectional', 'unidirectional'"),
    ({"local_window_blocks": [4, 0], "mode": "variable"}, "sparse_attention.local_window_blocks", ">= 1"),
])
def test_bad_section_names_the_key(section, path, words):
    with pytest.raises(ConfigError) as err:
        parsed(section)
    text = str(err.value)
    assert f"{path}:" in text and words in text, text


def test_engine_method_returns_the_sections_sparsity_config():
    engine = tiny_engine({"sparse_attention": {"mode": "bslongformer", "block": 8, "global_block_indices": [1]}})
    cfg = engine.sparse_attention_config(4)
    assert isinstance(cfg, BSLongformerSparsityConfig)
    assert (cfg.num_heads, cfg.block, cfg.global_block_indices, cfg.num_sliding_window_blocks) == (4, 8, [1], 3)
    engine.destroy()
    plain = tiny_engine()
    assert plain.sparse_attention_config(4) is None
    plain.destroy()


class TestSparseAttentionSection(SectionContract):
    plugin_name = "sparse_attention"
    section = {"mode": "fixed", "num_local_blocks": 2, "num_global_blocks": 2}


# --------------------------------------------------------------------------- import paths
def test_deepspeed_import_paths_resolve():
    from dsplug.ops import sparse_attention as sa
    from dsplug.ops.op_builder import SparseAttnBuilder
    from dsplug.ops.sparse_attention.sparsity_config import FixedSparsityConfig as FromSub
    from dsplug.unavailable import module_error

    for name in ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
                 "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
                 "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils"):
        assert getattr(sa, name).__name__ == name
    assert FromSub is sa.FixedSparsityConfig is FixedSparsityConfig
    assert dsplug.ops.sparse_attention is sa
    assert module_error("deepspeed.ops.sparse_attention") is None
    assert SparseAttnBuilder.NAME == "sparse_attn" and isinstance(SparseAttnBuilder().is_compatible(), bool)

    from dsplug.plugins.deepspeed_alias import finder

    if "deepspeed" in sys.modules:
        pytest.skip("a deepspeed module is already imported in this process")
    try:
        finder.install()
        ds_sa = importlib.import_module("deepspeed.ops.sparse_attention")
        assert ds_sa is sa and ds_sa.SparseSelfAttention is SparseSelfAttention
    finally:
        finder.uninstall()


# --------------------------------------------------------------------------- the module
def test_module_slices_the_master_layout_and_matches_the_kernel():
    cfg = FixedSparsityConfig(2, 16, num_local_blocks=2)
    attn = SparseSelfAttention(cfg, max_seq_length=256)
    assert torch.equal(attn.get_layout(64), cfg.make_layout(256)[:, :4, :4])
    assert "master_layout" in attn.state_dict()
    q, k, v = (torch.randn(2, 2, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = attn(q, k.transpose(-1, -2), v)  # key may come transposed, as in DeepSpeed
    from dsplug.plugins.sparse_attention.kernels import block_sparse_attention

    assert torch.equal(out, block_sparse_attention(q, k, v, attn.get_layout(64), 16))


def test_unidirectional_config_masks_the_future_inside_blocks():
    attn = SparseSelfAttention(LocalSlidingWindowSparsityConfig(1, 16), max_seq_length=64)
    q, k, v = (torch.randn(1, 1, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = attn(q, k, v)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])  # the first token sees only itself
    s = (q[0, 0, 17] @ k[0, 0, :18].T) / 8 ** 0.5  # token 17: block 1 and block 0, up to itself
    torch.testing.assert_close(out[0, 0, 17], torch.softmax(s, -1) @ v[0, 0, :18])


def test_loading_another_layout_changes_the_attention():
    a = SparseSelfAttention(BigBirdSparsityConfig(1, 16, num_random_blocks=1, seed=1), max_seq_length=128)
    b = SparseSelfAttention(BigBirdSparsityConfig(1, 16, num_random_blocks=1, seed=2), max_seq_length=128)
    assert not torch.equal(a.master_layout, b.master_layout)
    q = torch.randn(1, 1, 128, 4, generator=torch.Generator().manual_seed(0))
    before = a(q, q, q)
    a.load_state_dict(b.state_dict())
    assert torch.equal(a(q, q, q), b(q, q, q)) and not torch.equal(a(q, q, q), before)


def test_module_errors():
    with pytest.raises(ValueError, match="max_seq_length=100 is not a multiple of the sparsity config's block=16"):
        SparseSelfAttention(FixedSparsityConfig(2), max_seq_length=100)
    with pytest.raises(ValueError, match="attn_mask_mode='xor' is not valid"):
        SparseSelfAttention(FixedSparsityConfig(2), attn_mask_mode="xor")
    with pytest.raises(TypeError, match="sparsity_config must be a SparsityConfig"):
        SparseSelfAttention({"mode": "fixed"})
    attn = SparseSelfAttention(FixedSparsityConfig(2), max_seq_length=64)
    x = torch.zeros(1, 2, 128, 8)
    with pytest.raises(ValueError, match="seq_len=128 exceeds max_seq_length=64"):
        attn(x, x, x)
    x = torch.zeros(1, 3, 64, 8)
    with pytest.raises(ValueError, match="query has 3 heads but the sparsity config has num_heads=2"):
        attn(x, x, x)
    x = torch.zeros(1, 2, 40, 8)
    with pytest.raises(ValueError, match="seq_len=40 is not a multiple of block=16"):
        attn(x, x, x)
    assert isinstance(SparseSelfAttention().sparsity_config, FixedSparsityConfig)  # DeepSpeed's default: 4 heads


def _layout_after_forward(world_size):
    from dsplug import comm

    comm.init_distributed(dist_backend="gloo")
    rank = comm.get_rank()
    random.seed(100 + rank)  # ranks draw different random blocks ...
    attn = SparseSelfAttention(BigBirdSparsityConfig(2, 16, True, num_random_blocks=2), max_seq_length=256)
    drawn = attn.master_layout.clone()
    x = torch.randn(1, 2, 64, 4)
    attn(x, x, x)  # ... and the first forward makes them use rank 0's
    return drawn, attn.master_layout.clone()


@pytest.mark.slow
def test_layout_is_broadcast_from_rank_0():
    (drawn0, used0), (drawn1, used1) = run_distributed(_layout_after_forward, 2, 2)
    assert not torch.equal(drawn0, drawn1)
    assert torch.equal(used0, drawn0) and torch.equal(used1, drawn0)
