"""Pruning masks and physical shrinking (plugins/compression/masks.py, shrink.py), checked
against independent references written here in plain torch / python (sorting instead of topk,
explicit loops for block scores and N:M groups, masked models vs shrunk models)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dsplug.plugins.compression import masks as M
from dsplug.plugins.compression import shrink as S


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def ref_topk(scores, ratio):
    """Reference: sort descending, keep the first round(ratio*n) (clamped to [1, n])."""
    flat = scores.reshape(-1).tolist()
    n = len(flat)
    k = min(max(int(round(ratio * n)), 1), n)
    order = sorted(range(n), key=lambda i: -flat[i])
    out = [0.0] * n
    for i in order[:k]:
        out[i] = 1.0
    return torch.tensor(out).reshape(scores.shape)


# ----------------------------------------------------------------------------- kept counts, topk

@pytest.mark.parametrize("n,r,k", [(10, 0.5, 5), (10, 1.0, 10), (10, 0.01, 1), (7, 0.5, 4), (3, 0.34, 1),
                                   (1, 0.1, 1), (100, 0.999, 100), (8, 0.25, 2)])
def test_kept_count(n, r, k):
    assert M.kept_count(n, r) == k


@pytest.mark.parametrize("r", [0, 0.0, -0.1, 1.5, float("nan"), "x", None, True])
def test_kept_count_bad_ratio(r):
    with pytest.raises(ValueError, match="dense_ratio"):
        M.kept_count(10, r)


@pytest.mark.parametrize("shape", [(13,), (4, 6), (3, 2, 5)])
@pytest.mark.parametrize("r", [0.1, 0.3, 0.5, 0.77, 1.0])
def test_topk_and_sparse_l1(shape, r):
    w = torch.randn(shape, generator=gen(1))
    m = M.topk_mask(w, r)
    assert m.dtype == torch.float32 and m.shape == w.shape
    assert torch.equal(m, ref_topk(w, r))
    assert int(m.sum()) == M.kept_count(w.numel(), r)
    ms = M.sparse_l1_mask(w, r)
    assert torch.equal(ms, ref_topk(w.abs(), r))
    # kept magnitudes dominate pruned ones
    if r < 1:
        assert w.abs()[ms == 1].min() >= w.abs()[ms == 0].max()


def test_row_and_channel_l1():
    w = torch.randn(9, 5, generator=gen(2))
    ref_scores = torch.tensor([sum(abs(x) for x in row) for row in w.tolist()])
    m = M.row_l1_mask(w, 0.4)
    assert m.shape == (9,) and torch.equal(m, ref_topk(ref_scores, 0.4))
    c = torch.randn(6, 3, 2, 2, generator=gen(3))
    scores = torch.tensor([float(c[o].abs().sum()) for o in range(6)])
    for fn in (M.row_l1_mask, M.channel_l1_mask):
        mc = fn(c, 0.5)
        assert mc.shape == (6,) and torch.equal(mc, ref_topk(scores, 0.5))
    with pytest.raises(ValueError, match="shape"):
        M.row_l1_mask(torch.randn(4), 0.5)


def test_head_scores_l1():
    H, d, out = 4, 3, 5
    w = torch.randn(out, H * d, generator=gen(4))
    ref = torch.tensor([sum(abs(float(w[o, j])) for o in range(out) for j in range(h * d, h * d + d))
                        for h in range(H)])
    torch.testing.assert_close(M.head_scores_l1(w, H), ref)
    assert torch.equal(M.head_l1_mask(w, H, 0.5), ref_topk(ref, 0.5))
    with pytest.raises(ValueError, match=r"in_features=12.*num_heads=5"):
        M.head_scores_l1(w, 5)


def test_topk_binarizer_ste():
    scores = torch.randn(4, 5, generator=gen(5), dtype=torch.float64, requires_grad=True)
    mask = M.TopKBinarizer.apply(scores, 0.35)
    assert mask.dtype == torch.float64
    assert torch.equal(mask.float(), ref_topk(scores.detach().float(), 0.35))
    upstream = torch.randn(4, 5, generator=gen(6), dtype=torch.float64)
    mask.backward(upstream)
    assert torch.equal(scores.grad, upstream)
    s2 = scores.detach().clone().requires_grad_(True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=gen(7))
    (M.topk_binarize(s2, 0.35) * w).sum().backward()
    assert torch.equal(s2.grad, w)


# ----------------------------------------------------------------------------- block patterns

@pytest.mark.parametrize("text,kind,n,m", [("4x1", "NxM", 4, 1), ("1x16", "NxM", 1, 16), ("2:4", "N:M", 2, 4),
                                           (" 1:2 ", "N:M", 1, 2), ("4:4", "N:M", 4, 4), ("2X2", "NxM", 2, 2)])
def test_parse_block_pattern(text, kind, n, m):
    p = M.parse_block_pattern(text)
    assert (p.kind, p.n, p.m) == (kind, n, m)
    assert M.parse_block_pattern(p) is p


@pytest.mark.parametrize("text", ["", "4", "4x", "x4", "0x1", "2:0", "5:4", "2:4:8", "4x1x2", "a:b", "-1x2",
                                  "2.0:4", "4*1", None, 4])
def test_parse_block_pattern_errors(text):
    with pytest.raises(ValueError) as ei:
        M.parse_block_pattern(text)
    msg = str(ei.value)
    assert repr(text) in msg and "NxM" in msg and "N:M" in msg and "4x1" in msg and "2:4" in msg


def ref_block_scores(s, n, m):
    s2 = s.reshape(s.shape[0], -1)
    R, C = s2.shape
    return [[sum(float(s2[r, c]) for r in range(a * n, a * n + n) for c in range(b * m, b * m + m))
             for b in range(C // m)] for a in range(R // n)]


def test_block_mask_global_nxm():
    torch.manual_seed(0)
    scores = {"a": torch.rand(4, 6, generator=gen(8)), "b": torch.rand(6, 2, 1, 2, generator=gen(9))}
    n, m = 2, 2
    blocks = []  # (score, name, a, b)
    for name, s in scores.items():
        for a, row in enumerate(ref_block_scores(s, n, m)):
            for b, v in enumerate(row):
                blocks.append((v, name, a, b))
    assert len(blocks) == 6 + 6
    for sp in [0.0, 0.25, 0.5, 0.9]:
        out = M.block_mask(scores, "2x2", sp)
        n_prune = int(round(sp * len(blocks)))
        pruned = {(nm, a, b) for _, nm, a, b in sorted(blocks)[:n_prune]}
        for name, s in scores.items():
            ref = torch.ones(s.shape[0], s[0].numel())
            for (nm, a, b) in pruned:
                if nm == name:
                    ref[a * n:a * n + n, b * m:b * m + m] = 0
            assert out[name].shape == s.shape and out[name].dtype == torch.float32
            assert torch.equal(out[name], ref.reshape(s.shape)), (sp, name)
        total_zero = sum(int((o == 0).sum()) for o in out.values())
        assert total_zero == n_prune * n * m
    # global, not per tensor: make every block of "a" score lower than any of "b"
    out = M.block_mask({"a": scores["a"] * 0.01, "b": scores["b"] + 10}, "2x2", 0.5)
    assert int(out["a"].sum()) == 0 and int(out["b"].sum()) == scores["b"].numel()


def test_block_mask_errors():
    with pytest.raises(ValueError, match=r"\(5, 4\).*'2x2'"):
        M.block_mask({"w": torch.rand(5, 4)}, "2x2", 0.5)
    with pytest.raises(ValueError, match=r"\(4, 6\).*'2:4'"):
        M.block_mask({"w": torch.rand(4, 6)}, "2:4", 0.5)
    with pytest.raises(ValueError, match="sparsity"):
        M.block_mask({"w": torch.rand(4, 4)}, "2x2", 1.0)
    assert M.block_mask({}, "2x2", 0.5) == {}


@pytest.mark.parametrize("pattern,n,m", [("2:4", 2, 4), ("1:4", 1, 4), ("1:2", 1, 2), ("3:8", 3, 8)])
def test_nm_mask(pattern, n, m):
    s = torch.randn(5, 2, 2, 4, generator=gen(10))  # conv-like, viewed as [5, 16]
    out = M.block_mask({"w": s}, pattern, 0.5)["w"]
    assert out.shape == s.shape
    o2, s2 = out.reshape(5, -1), s.reshape(5, -1)
    ref = torch.zeros_like(s2)
    for r in range(5):
        for g in range(16 // m):
            vals = [(float(s2[r, g * m + j]), j) for j in range(m)]
            for _, j in sorted(vals, reverse=True)[:n]:
                ref[r, g * m + j] = 1
            assert int(o2[r, g * m:g * m + m].sum()) == n
    assert torch.equal(o2, ref)
    assert torch.equal(M.block_mask({"w": s}, pattern, 0.0)["w"], torch.ones_like(s))


def test_snip_momentum_scores():
    w, g = torch.randn(3, 4, generator=gen(11)), torch.randn(3, 4, generator=gen(12))
    s0 = M.snip_momentum_scores(None, w, g)
    torch.testing.assert_close(s0, (w * g).abs())
    w2, g2 = torch.randn(3, 4, generator=gen(13)), torch.randn(3, 4, generator=gen(14))
    s1 = M.snip_momentum_scores(s0, w2, g2, beta=0.8)
    torch.testing.assert_close(s1, 0.8 * (w * g).abs() + 0.2 * (w2 * g2).abs())
    with pytest.raises(ValueError, match="grad"):
        M.snip_momentum_scores(None, w, None)


def test_cubic_sparsity():
    start, end, stride, sf = 10, 50, 5, 0.8

    def ref(t):
        return sf * (1 - (1 - (t - start) / (end - start)) ** 3)

    for step in [0, 5, 9]:
        assert M.cubic_sparsity(step, start, end, stride, sf) == 0.0
    assert M.cubic_sparsity(start, start, end, stride, sf) == 0.0
    for step in [50, 51, 1000]:
        assert M.cubic_sparsity(step, start, end, stride, sf) == sf
    for t in range(start, end, stride):  # plateaus: constant on [t, t+stride)
        for step in range(t, t + stride):
            assert math.isclose(M.cubic_sparsity(step, start, end, stride, sf), ref(t), abs_tol=1e-12)
    assert math.isclose(M.cubic_sparsity(30, start, end, stride, sf), sf * (1 - 0.5 ** 3))
    vals = [M.cubic_sparsity(s, start, end, stride, sf) for s in range(0, 60)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))
    assert math.isclose(M.cubic_sparsity(29, start, end, 1, sf), ref(29))
    with pytest.raises(ValueError, match="end"):
        M.cubic_sparsity(0, 10, 10, 1, sf)
    with pytest.raises(ValueError, match="stride"):
        M.cubic_sparsity(0, 0, 10, 0, sf)


# ----------------------------------------------------------------------------- shrinking

def test_keep_indices():
    assert S.keep_indices(torch.tensor([0., 1., 0., 1., 1.])).tolist() == [1, 3, 4]
    assert S.keep_indices(torch.tensor([True, False])).dtype == torch.long
    assert S.head_keep_indices(torch.tensor([1., 0., 1.]), 2).tolist() == [0, 1, 4, 5]


def test_linear_row_pruning_equivalence():
    torch.manual_seed(0)
    l1, l2 = nn.Linear(6, 8).double(), nn.Linear(8, 3).double()
    l1.weight.requires_grad_(False)
    x = torch.randn(5, 6, dtype=torch.float64)
    mask = M.row_l1_mask(l1.weight, 0.5)
    masked = l2(F.relu(F.linear(x, l1.weight * mask[:, None], l1.bias * mask)))
    keep = S.keep_indices(mask)
    n1, n2 = S.shrink_linear_out(l1, keep), S.related_shrink(l2, keep)
    assert type(n1) is nn.Linear and n1.weight.shape == (4, 6) and n2.weight.shape == (3, 4)
    assert n1.weight.dtype == torch.float64 and n1.out_features == 4 and n2.in_features == 4
    assert not n1.weight.requires_grad and n1.bias.requires_grad and n2.weight.requires_grad
    torch.testing.assert_close(n2(F.relu(n1(x))), masked, atol=1e-6, rtol=0)
    # copies, not views; originals untouched
    n1.weight.data.zero_()
    assert l1.weight.abs().sum() > 0 and l1.out_features == 8
    # a mask is accepted in place of indices, and the RNG is not consumed
    state = torch.get_rng_state()
    n3 = S.shrink_linear_out(l1, mask)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(n3.weight, l1.weight[keep])
    no_bias = S.shrink_linear_in(nn.Linear(8, 2, bias=False), keep)
    assert no_bias.bias is None and no_bias.in_features == 4


def test_conv_bn_channel_pruning_equivalence():
    torch.manual_seed(1)
    c1, bn, c2 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Conv2d(6, 4, 3, stride=2)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn.num_batches_tracked.fill_(7)
    model = nn.Sequential(c1, bn, nn.ReLU(), c2).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    mask = M.channel_l1_mask(c1.weight, 0.5)
    keep = S.keep_indices(mask)
    # masked reference: pruned channels are zero after conv1 and BN (so unused by conv2)
    h = F.conv2d(x, c1.weight * mask[:, None, None, None], c1.bias * mask, padding=1)
    h = F.relu(bn(h) * mask[None, :, None, None])
    masked = c2(h)
    shrunk = nn.Sequential(S.shrink_conv_out(c1, keep), S.related_shrink(bn, keep), nn.ReLU(),
                           S.related_shrink(c2, keep))
    assert shrunk[0].weight.shape == (3, 3, 3, 3) and shrunk[3].weight.shape == (4, 3, 3, 3)
    nb = shrunk[1]
    assert type(nb) is nn.BatchNorm2d and nb.num_features == 3 and not nb.training
    assert torch.equal(nb.running_var, bn.running_var[keep]) and int(nb.num_batches_tracked) == 7
    assert (shrunk[3].stride, shrunk[0].padding) == ((2, 2), (1, 1))
    torch.testing.assert_close(shrunk(x), masked, atol=1e-6, rtol=0)


def test_shrink_errors():
    g = nn.Conv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match=r"Conv2d\(4, 4.*groups=2"):
        S.shrink_conv_out(g, [0, 1])
    with pytest.raises(ValueError, match="groups"):
        S.related_shrink(g, [0])
    with pytest.raises(TypeError, match=r"LayerNorm.*nn.Linear.*Conv2d.*BatchNorm2d"):
        S.related_shrink(nn.LayerNorm(4), [0])
    with pytest.raises(ValueError, match="nothing kept"):
        S.shrink_linear_out(nn.Linear(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        S.shrink_linear_out(nn.Linear(2, 3), [0, 3])
    with pytest.raises(ValueError, match="features=10.*stacked \\(3\\).*num_heads \\(2\\).*head_dim \\(2\\)"):
        S.shrink_linear_heads_out(nn.Linear(4, 10), torch.ones(2), 2, stacked=3)


class MHA(nn.Module):
    """Plain multi-head self-attention; ``fused`` uses one qkv projection laid out q|k|v."""

    def __init__(self, dim, heads, head_dim, fused):
        super().__init__()
        self.heads, self.head_dim, self.fused = heads, head_dim, fused
        inner = heads * head_dim
        if fused:
            self.qkv = nn.Linear(dim, 3 * inner)
        else:
            self.q, self.k, self.v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.out = nn.Linear(inner, dim)

    def forward(self, x, head_mask=None):
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.reshape(B, T, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        ctx = (att @ v).transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        w = self.out.weight
        if head_mask is not None:  # zero the out-projection's input columns of pruned heads
            w = w * head_mask.repeat_interleave(self.head_dim)[None, :]
        return F.linear(ctx, w, self.out.bias)


@pytest.mark.parametrize("fused", [False, True])
def test_head_pruning_equivalence(fused):
    torch.manual_seed(2)
    dim, H, d = 8, 4, 3
    attn = MHA(dim, H, d, fused).double()
    x = torch.randn(2, 5, dim, dtype=torch.float64)
    head_mask = M.head_l1_mask(attn.out.weight, H, 0.5).double()
    assert int(head_mask.sum()) == 2
    masked = attn(x, head_mask)
    if fused:
        attn.qkv = S.shrink_linear_heads_out(attn.qkv, head_mask, d, stacked=3)
        assert attn.qkv.weight.shape == (3 * 2 * d, dim)
        kept = S.head_keep_indices(head_mask, d)
        # chunk order q|k|v preserved
        ref_rows = torch.cat([kept, kept + H * d, kept + 2 * H * d])
        assert ref_rows.tolist() == sorted(ref_rows.tolist())
    else:
        for name in ("q", "k", "v"):
            S.replace_module(attn, name, S.shrink_linear_heads_out(getattr(attn, name), head_mask, d))
            assert getattr(attn, name).weight.shape == (2 * d, dim)
    attn.out = S.shrink_linear_in(attn.out, S.head_keep_indices(head_mask, d))
    assert attn.out.weight.shape == (dim, 2 * d)
    attn.heads = 2
    torch.testing.assert_close(attn(x), masked, atol=1e-6, rtol=0)
    # shrink_linear_heads_in == shrink_linear_in with head columns
    o = nn.Linear(H * d, dim)
    a, b = S.shrink_linear_heads_in(o, head_mask, d), S.shrink_linear_in(o, S.head_keep_indices(head_mask, d))
    assert torch.equal(a.weight, b.weight)


def test_replace_module():
    root = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Sequential(nn.Linear(2, 3))]))
    new = nn.Linear(2, 5)
    old = S.replace_module(root, "1.1.0", new)
    assert isinstance(old, nn.Linear) and root[1][1][0] is new
    S.replace_module(root, "0", nn.Identity())
    assert isinstance(root[0], nn.Identity)
    with pytest.raises(AttributeError, match="'nope'"):
        S.replace_module(root, "1.nope", new)
    with pytest.raises(AttributeError, match="'7'"):
        S.replace_module(root, "1.7", new)
