// The sparse_attn op: block-sparse SDDMM, row softmax and SpMM (forward and backward) for
// block-sparse attention on fp32 CPU buffers (the Python bindings are sparse_attention_bindings.cpp,
// a separate translation unit so that the two compile in parallel and the bindings at -O1). The contract is in
// sparse_attention.h; the pure-torch fallback (dsplug.plugins.sparse_attention.fallback) computes
// the same quantities by gathering the nonzero blocks and using batched matmuls.
//
// SIMD: the kernels are written with the compiler's generic vector type (`vf`, VW floats: 16 when
// the build targets AVX-512, 8 with AVX, 4 otherwise) and plain loops over compile-time sizes;
// the compiler picks the instructions (built with -O3 -march=native and FMA contraction). Each
// register tile is kRows output rows x two vectors of columns, accumulated over the whole
// reduction before it is stored, so a tile's products stay in registers. Block sizes 16, 32, 64
// and 128 have these kernels; any other block size runs a generic (slower) path.
//
// The score tile of block (h, r, c) is A_r . B_c^T; its inner loop reads B_c block-transposed
// ([D][blk], contiguous rows of blk floats), so each call first copies B in that form (one pass
// over B, parallel).
#include "sparse_attention.h"
#include "dsplug_parallel_units.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && !defined(DSPLUG_SIMD_SCALAR)
#define DSPLUG_SA_VW 16
#elif defined(__AVX__) && !defined(DSPLUG_SIMD_SCALAR)
#define DSPLUG_SA_VW 8
#else
#define DSPLUG_SA_VW 4
#endif

namespace dsplug {
namespace sparse {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------ vectors
constexpr int VW = DSPLUG_SA_VW;
typedef float vf __attribute__((vector_size(DSPLUG_SA_VW * sizeof(float)), aligned(4), may_alias));
inline vf vload(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

constexpr int kRows = VW >= 16 ? 8 : 4;  // output rows per register tile (32 vector registers with AVX-512)
constexpr int kCols = 2 * VW;             // columns (score tiles) / head-dim chunk (spmm) per register tile

// ------------------------------------------------------------------ threads
// parallel_units: dsplug_parallel_units.h

// Per-thread buffers: tiles of one block-row (or block-column) and pointer lists.
struct Scratch {
    std::vector<float> a, b;
    std::vector<const float*> p1, p2, p3, p4;
    float* tiles_a(size_t n) {
        if (a.size() < n) a.resize(n);
        return a.data();
    }
    float* tiles_b(size_t n) {
        if (b.size() < n) b.resize(n);
        return b.data();
    }
    void lists(size_t n) {
        for (auto* v : {&p1, &p2, &p3, &p4})
            if (v->size() < n) v->resize(n);
    }
};
Scratch& scratch() {
    thread_local Scratch s;
    return s;
}

// ------------------------------------------------------------------ exp
// exp(x) for x <= 0 with ~1 ulp error (Cephes' expf polynomial after the range reduction
// x = n ln2 + r, |r| <= ln2 / 2), branch-free so that loops over it vectorize; below
// -87.33 (where expf leaves the normal range) the result is 0, so -inf maps to exactly 0.
inline float exp_nonpositive(float x) {
    const float lo = -87.3365478515625f;
    float xc = x < lo ? lo : x;
    xc = xc > 0.f ? 0.f : xc;
    float n = xc * 1.44269504088896341f;
    n = (n + 12582912.f) - 12582912.f;  // round to nearest integer (|n| < 2^22)
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return x < lo ? 0.f : y * scale;
}

// ------------------------------------------------------------------ tile kernels
template <int BT>
constexpr bool kFast = BT != 0 && BT % VW == 0 && BT % kRows == 0;

// c (blk x blk) = a (blk rows of D, stride D) . B^T with B given block-transposed: bt = [D][blk].
template <int BT>
inline void tile_sdd(const float* __restrict a, const float* __restrict bt, float* __restrict c, int64_t D,
                     int64_t blk_rt) {
    if constexpr (!kFast<BT>) {
        const int64_t blk = BT ? BT : blk_rt;
        for (int64_t i = 0; i < blk; ++i) {
            float* ci = c + i * blk;
            for (int64_t j = 0; j < blk; ++j) ci[j] = 0.f;
            for (int64_t d = 0; d < D; ++d) {
                const float av = a[i * D + d];
                const float* row = bt + d * blk;
                for (int64_t j = 0; j < blk; ++j) ci[j] += av * row[j];
            }
        }
    } else {
        constexpr int R = kRows;
        constexpr int JW = BT < kCols ? BT : kCols;
        constexpr int NV = JW / VW;
        for (int i0 = 0; i0 < BT; i0 += R) {
            const float* arow = a + int64_t(i0) * D;
            for (int j0 = 0; j0 < BT; j0 += JW) {
                vf acc[R][NV];
                for (int ii = 0; ii < R; ++ii)
                    for (int w = 0; w < NV; ++w) acc[ii][w] = vf{};
                const float* bcol = bt + j0;
                for (int64_t d = 0; d < D; ++d) {
                    vf row[NV];
                    for (int w = 0; w < NV; ++w) row[w] = vload(bcol + d * BT + w * VW);
                    for (int ii = 0; ii < R; ++ii) {
                        const float av = arow[ii * D + d];
                        for (int w = 0; w < NV; ++w) acc[ii][w] += av * row[w];
                    }
                }
                for (int ii = 0; ii < R; ++ii)
                    for (int w = 0; w < NV; ++w) vstore(c + (i0 + ii) * BT + j0 + w * VW, acc[ii][w]);
            }
        }
    }
}

// out rows [i0, i0 + R) x columns [d0, d0 + NV * VW) = alpha * sum_e op(tiles[e]) . brows[e]
// (op: identity, or transpose when T); brows[e] points at blk rows of stride D.
template <int BT, int R, int NV, bool T>
inline void spmm_tile(int64_t n, const float* const* tiles, const float* const* brows, int64_t i0, int64_t d0,
                      float* __restrict out, int64_t D, float alpha, int64_t blk_rt) {
    const int64_t blk = BT ? BT : blk_rt;
    vf acc[R][NV];
    for (int ii = 0; ii < R; ++ii)
        for (int w = 0; w < NV; ++w) acc[ii][w] = vf{};
    for (int64_t e = 0; e < n; ++e) {
        const float* tile = tiles[e];
        const float* br = brows[e] + d0;
        for (int64_t j = 0; j < blk; ++j) {
            vf row[NV];
            for (int w = 0; w < NV; ++w) row[w] = vload(br + j * D + w * VW);
            for (int ii = 0; ii < R; ++ii) {
                const float cv = T ? tile[j * blk + i0 + ii] : tile[(i0 + ii) * blk + j];
                for (int w = 0; w < NV; ++w) acc[ii][w] += cv * row[w];
            }
        }
    }
    for (int ii = 0; ii < R; ++ii)
        for (int w = 0; w < NV; ++w) vstore(out + (i0 + ii) * D + d0 + w * VW, alpha * acc[ii][w]);
}

template <int BT, int R, bool T>
inline void spmm_column(int64_t n, const float* const* tiles, const float* const* brows, int64_t i0, int64_t d0,
                        float* __restrict out, int64_t D, float alpha, int64_t blk_rt) {
    const int64_t blk = BT ? BT : blk_rt;
    float acc[R] = {};
    for (int64_t e = 0; e < n; ++e)
        for (int64_t j = 0; j < blk; ++j) {
            const float bv = brows[e][j * D + d0];
            for (int ii = 0; ii < R; ++ii)
                acc[ii] += (T ? tiles[e][j * blk + i0 + ii] : tiles[e][(i0 + ii) * blk + j]) * bv;
        }
    for (int ii = 0; ii < R; ++ii) out[(i0 + ii) * D + d0] = alpha * acc[ii];
}

// out (blk x D, stride D) = alpha * sum_e op(tiles[e]) . brows[e]; every element is written.
template <int BT, bool T>
void tiles_spmm(int64_t n, const float* const* tiles, const float* const* brows, float* out, int64_t D, float alpha,
                int64_t blk_rt) {
    const int64_t blk = BT ? BT : blk_rt;
    constexpr int R = kFast<BT> ? kRows : 1;
    for (int64_t i0 = 0; i0 < blk; i0 += R) {
        int64_t d0 = 0;
        for (; d0 + kCols <= D; d0 += kCols)
            spmm_tile<BT, R, kCols / VW, T>(n, tiles, brows, i0, d0, out, D, alpha, blk);
        for (; d0 + VW <= D; d0 += VW) spmm_tile<BT, R, 1, T>(n, tiles, brows, i0, d0, out, D, alpha, blk);
        for (; d0 < D; ++d0) spmm_column<BT, R, T>(n, tiles, brows, i0, d0, out, D, alpha, blk);
    }
}

// x <- scale * x + rpe + key_padding + attn_mask on the tile of block (b, h, r, c); -inf where
// col > row when causal.
template <int BT>
inline void apply_terms(float* tile, const Problem& p, const SoftmaxTerms& t, int64_t b, int64_t h, int64_t r,
                        int64_t c) {
    const int64_t blk = BT ? BT : p.blk;
    if (t.causal && c > r) {
        for (int64_t x = 0; x < blk * blk; ++x) tile[x] = kNegInf;
        return;
    }
    const int64_t gc = c * blk;
    for (int64_t i = 0; i < blk; ++i) {
        float* x = tile + i * blk;
        const int64_t gi = r * blk + i;
        for (int64_t j = 0; j < blk; ++j) x[j] *= t.scale;
        if (t.rpe) {
            const float* pr = t.rpe + b * t.rpe_sb + h * t.rpe_sh + gi * p.S + gc;
            for (int64_t j = 0; j < blk; ++j) x[j] += pr[j];
        }
        if (t.kp) {
            const float* pk = t.kp + b * t.kp_sb + gc;
            for (int64_t j = 0; j < blk; ++j) x[j] += pk[j];
        }
        if (t.am) {
            const float* pa = t.am + gi * p.S + gc;
            for (int64_t j = 0; j < blk; ++j) x[j] += pa[j];
        }
        if (t.causal && c == r)
            for (int64_t j = i + 1; j < blk; ++j) x[j] = kNegInf;
    }
}

// Softmax along each token row of n consecutive tiles (one block-row); lse (blk entries, may be
// null) receives log(sum_j exp(x_ij)), +inf for a row without a finite entry (then all zeros).
template <int BT>
void softmax_tiles(float* tiles, int64_t n, int64_t blk_rt, float* lse) {
    const int64_t blk = BT ? BT : blk_rt;
    const int64_t blk2 = blk * blk;
    float part_stack[BT ? BT : 1];
    std::vector<float> part_heap(BT ? 0 : size_t(blk));
    float* part = BT ? part_stack : part_heap.data();
    for (int64_t i = 0; i < blk; ++i) {
        for (int64_t j = 0; j < blk; ++j) part[j] = kNegInf;
        for (int64_t e = 0; e < n; ++e) {
            const float* x = tiles + e * blk2 + i * blk;
            for (int64_t j = 0; j < blk; ++j) part[j] = x[j] > part[j] ? x[j] : part[j];
        }
        float mx = kNegInf;
        for (int64_t j = 0; j < blk; ++j) mx = part[j] > mx ? part[j] : mx;
        if (!(mx > kNegInf)) {  // nothing to attend to
            for (int64_t e = 0; e < n; ++e) {
                float* x = tiles + e * blk2 + i * blk;
                for (int64_t j = 0; j < blk; ++j) x[j] = 0.f;
            }
            if (lse) lse[i] = kPosInf;
            continue;
        }
        for (int64_t j = 0; j < blk; ++j) part[j] = 0.f;
        for (int64_t e = 0; e < n; ++e) {
            float* x = tiles + e * blk2 + i * blk;
            for (int64_t j = 0; j < blk; ++j) {
                const float v = exp_nonpositive(x[j] - mx);
                x[j] = v;
                part[j] += v;
            }
        }
        float sum = 0.f;
        for (int64_t j = 0; j < blk; ++j) sum += part[j];
        const float inv = 1.f / sum;  // sum >= 1: the maximum contributes exp(0)
        for (int64_t e = 0; e < n; ++e) {
            float* x = tiles + e * blk2 + i * blk;
            for (int64_t j = 0; j < blk; ++j) x[j] *= inv;
        }
        if (lse) lse[i] = mx + std::log(sum);
    }
}

// tile <- exp(tile - lse_row): the probabilities from the saved log-sum-exp.
template <int BT>
inline void exp_minus_rows(float* tile, const float* lse, int64_t blk_rt) {
    const int64_t blk = BT ? BT : blk_rt;
    for (int64_t i = 0; i < blk; ++i) {
        float* x = tile + i * blk;
        const float l = lse[i];
        for (int64_t j = 0; j < blk; ++j) x[j] = exp_nonpositive(x[j] - l);
    }
}

// g <- p * (g - delta_row)
template <int BT>
inline void softmax_grad_rows(const float* p, float* g, const float* delta, int64_t blk_rt) {
    const int64_t blk = BT ? BT : blk_rt;
    for (int64_t i = 0; i < blk; ++i) {
        const float d = delta[i];
        for (int64_t j = 0; j < blk; ++j) g[i * blk + j] = p[i * blk + j] * (g[i * blk + j] - d);
    }
}

// delta[i] = sum over n consecutive tile pairs of p[i][:] . g[i][:]
template <int BT>
void row_dots(const float* p, const float* g, int64_t n, int64_t blk_rt, float* delta) {
    const int64_t blk = BT ? BT : blk_rt;
    const int64_t blk2 = blk * blk;
    float part_stack[BT ? BT : 1];
    std::vector<float> part_heap(BT ? 0 : size_t(blk));
    float* part = BT ? part_stack : part_heap.data();
    for (int64_t i = 0; i < blk; ++i) {
        for (int64_t j = 0; j < blk; ++j) part[j] = 0.f;
        for (int64_t e = 0; e < n; ++e) {
            const float* pp = p + e * blk2 + i * blk;
            const float* gg = g + e * blk2 + i * blk;
            for (int64_t j = 0; j < blk; ++j) part[j] += pp[j] * gg[j];
        }
        float s = 0.f;
        for (int64_t j = 0; j < blk; ++j) s += part[j];
        delta[i] = s;
    }
}

// ------------------------------------------------------------------ problem helpers
struct Unit {
    int64_t b, h, x;  // x: block-row or block-column
    int64_t bh;
};
inline Unit unit_of(const Problem& p, int64_t u) {
    const int64_t bh = u / p.nb;
    return {bh / p.H, bh % p.H, u % p.nb, bh};
}

// B block-transposed: bt[(bh * nb + c) * D * blk + d * blk + j] = B[bh][c * blk + j][d].
std::unique_ptr<float[]> transposed_blocks(const Problem& p, const float* src, int threads) {
    std::unique_ptr<float[]> bt(new float[size_t(p.B * p.H * p.S * p.D)]);
    const int64_t blk = p.blk, D = p.D;
    float* dst_all = bt.get();
    parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
        const float* s = src + u * blk * D;
        float* d = dst_all + u * blk * D;
        for (int64_t j = 0; j < blk; ++j)
            for (int64_t x = 0; x < D; ++x) d[x * blk + j] = s[j * D + x];
    });
    return bt;
}

template <class F>
void dispatch_block(int64_t blk, F&& f) {
    switch (blk) {
        case 16: f(std::integral_constant<int, 16>{}); break;
        case 32: f(std::integral_constant<int, 32>{}); break;
        case 64: f(std::integral_constant<int, 64>{}); break;
        case 128: f(std::integral_constant<int, 128>{}); break;
        default: f(std::integral_constant<int, 0>{}); break;
    }
}

// ------------------------------------------------------------------ fused attention units
template <int BT>
void forward_unit(const Problem& p, const SoftmaxTerms& t, const float* q, const float* kt, const float* v,
                  float* out, float* lse, float* prob, const Unit& w) {
    const int64_t blk = p.blk, blk2 = blk * blk, D = p.D;
    const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1], n = k1 - k0;
    Scratch& s = scratch();
    float* tiles = prob ? prob + (w.b * p.nnz + k0) * blk2 : s.tiles_a(size_t(n * blk2));
    s.lists(size_t(n));
    const float* a = q + (w.bh * p.S + w.x * blk) * D;
    for (int64_t e = 0; e < n; ++e) {
        const int64_t c = p.cols[k0 + e];
        float* tile = tiles + e * blk2;
        tile_sdd<BT>(a, kt + (w.bh * p.nb + c) * D * blk, tile, D, blk);
        apply_terms<BT>(tile, p, t, w.b, w.h, w.x, c);
        s.p1[e] = tile;
        s.p2[e] = v + (w.bh * p.S + c * blk) * D;
    }
    float lse_stack[BT ? BT : 1];
    std::vector<float> lse_heap(BT ? 0 : size_t(blk));
    float* row_lse = lse ? lse + w.bh * p.S + w.x * blk : (BT ? lse_stack : lse_heap.data());
    softmax_tiles<BT>(tiles, n, blk, row_lse);
    tiles_spmm<BT, false>(n, s.p1.data(), s.p2.data(), out + (w.bh * p.S + w.x * blk) * D, D, 1.f, blk);
}

// One tile of the backward pass: p <- exp(x - lse) (the probabilities), g <- dout_r . v_c^T.
template <int BT>
inline void backward_tiles(const Problem& p, const SoftmaxTerms& t, const float* q, const float* kt,
                           const float* dout, const float* vt, const float* lse, const Unit& w, int64_t r, int64_t c,
                           float* ptile, float* gtile) {
    const int64_t blk = p.blk, D = p.D;
    const int64_t row0 = w.bh * p.S + r * blk;
    tile_sdd<BT>(q + row0 * D, kt + (w.bh * p.nb + c) * D * blk, ptile, D, blk);
    apply_terms<BT>(ptile, p, t, w.b, w.h, r, c);
    exp_minus_rows<BT>(ptile, lse + row0, blk);
    tile_sdd<BT>(dout + row0 * D, vt + (w.bh * p.nb + c) * D * blk, gtile, D, blk);
}

template <int BT>
void backward_row_unit(const Problem& p, const SoftmaxTerms& t, const float* q, const float* k, const float* kt,
                       const float* vt, const float* dout, const float* lse, float* delta, float* dq, float* grad,
                       const Unit& w) {
    const int64_t blk = p.blk, blk2 = blk * blk, D = p.D;
    const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1], n = k1 - k0;
    Scratch& s = scratch();
    float* ptiles = s.tiles_a(size_t(n * blk2));
    float* gtiles = grad ? grad + (w.b * p.nnz + k0) * blk2 : s.tiles_b(size_t(n * blk2));
    s.lists(size_t(n));
    for (int64_t e = 0; e < n; ++e) {
        const int64_t c = p.cols[k0 + e];
        backward_tiles<BT>(p, t, q, kt, dout, vt, lse, w, w.x, c, ptiles + e * blk2, gtiles + e * blk2);
        s.p1[e] = gtiles + e * blk2;
        s.p2[e] = k + (w.bh * p.S + c * blk) * D;
    }
    float* row_delta = delta + w.bh * p.S + w.x * blk;
    row_dots<BT>(ptiles, gtiles, n, blk, row_delta);
    for (int64_t e = 0; e < n; ++e) softmax_grad_rows<BT>(ptiles + e * blk2, gtiles + e * blk2, row_delta, blk);
    tiles_spmm<BT, false>(n, s.p1.data(), s.p2.data(), dq + (w.bh * p.S + w.x * blk) * D, D, t.scale, blk);
}

template <int BT>
void backward_col_unit(const Problem& p, const SoftmaxTerms& t, const float* q, const float* kt, const float* vt,
                       const float* dout, const float* lse, const float* delta, float* dk, float* dv,
                       const Unit& w) {
    const int64_t blk = p.blk, blk2 = blk * blk, D = p.D;
    const int64_t c = w.x;
    const int64_t e0 = p.col_ptr[w.h * p.nb + c], e1 = p.col_ptr[w.h * p.nb + c + 1], n = e1 - e0;
    Scratch& s = scratch();
    float* ptiles = s.tiles_a(size_t(n * blk2));
    float* gtiles = s.tiles_b(size_t(n * blk2));
    s.lists(size_t(n));
    for (int64_t idx = 0; idx < n; ++idx) {
        const int64_t r = p.col_rows[e0 + idx];
        float* pt = ptiles + idx * blk2;
        float* gt = gtiles + idx * blk2;
        backward_tiles<BT>(p, t, q, kt, dout, vt, lse, w, r, c, pt, gt);
        softmax_grad_rows<BT>(pt, gt, delta + w.bh * p.S + r * blk, blk);
        s.p1[idx] = pt;
        s.p2[idx] = dout + (w.bh * p.S + r * blk) * D;
        s.p3[idx] = gt;
        s.p4[idx] = q + (w.bh * p.S + r * blk) * D;
    }
    tiles_spmm<BT, true>(n, s.p1.data(), s.p2.data(), dv + (w.bh * p.S + c * blk) * D, D, 1.f, blk);
    tiles_spmm<BT, true>(n, s.p3.data(), s.p4.data(), dk + (w.bh * p.S + c * blk) * D, D, t.scale, blk);
}

}  // namespace

// ------------------------------------------------------------------ public entry points
void check_problem(const Problem& p) {
    auto bad = [](const std::string& what) { throw std::invalid_argument("sparse_attn: " + what); };
    if (p.B < 0 || p.H < 1 || p.S < 0 || p.D < 1 || p.blk < 1) bad("invalid shape");
    if (p.S % p.blk != 0)
        bad("sequence length " + std::to_string(p.S) + " is not a multiple of block " + std::to_string(p.blk));
    if (p.nb != p.S / p.blk) bad("nb must equal S / blk");
    if (p.nnz < 0 || p.nnz > p.H * p.nb * p.nb) bad("invalid nnz");
    if (!p.row_ptr || !p.col_ptr) bad("missing layout index (row_ptr / col_ptr)");
    // the per-block arrays are empty (their data pointer may be null) when no block is nonzero
    if (p.nnz > 0 && (!p.cols || !p.col_rows || !p.col_ids)) bad("missing layout index (cols / col_rows / col_ids)");
    if (p.row_ptr[0] != 0 || p.row_ptr[p.H * p.nb] != p.nnz || p.col_ptr[p.H * p.nb] != p.nnz)
        bad("layout index does not match nnz");
}

void sdd(const Problem& p, const float* a, const float* b, float* out, int threads) {
    check_problem(p);
    if (p.B == 0 || p.nnz == 0) return;
    auto bt = transposed_blocks(p, b, threads);
    const int64_t blk = p.blk, blk2 = blk * blk;
    dispatch_block(blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            const Unit w = unit_of(p, u);
            const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1];
            const float* arow = a + (w.bh * p.S + w.x * blk) * p.D;
            for (int64_t k = k0; k < k1; ++k)
                tile_sdd<BT>(arow, bt.get() + (w.bh * p.nb + p.cols[k]) * p.D * blk, out + (w.b * p.nnz + k) * blk2,
                             p.D, blk);
        });
    });
}

void dsd(const Problem& p, const float* vals, const float* b, float* out, float alpha, int threads) {
    check_problem(p);
    const int64_t blk = p.blk, blk2 = blk * blk;
    dispatch_block(blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            const Unit w = unit_of(p, u);
            const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1];
            Scratch& s = scratch();
            s.lists(size_t(k1 - k0));
            for (int64_t k = k0; k < k1; ++k) {
                s.p1[k - k0] = vals + (w.b * p.nnz + k) * blk2;
                s.p2[k - k0] = b + (w.bh * p.S + p.cols[k] * blk) * p.D;
            }
            tiles_spmm<BT, false>(k1 - k0, s.p1.data(), s.p2.data(), out + (w.bh * p.S + w.x * blk) * p.D, p.D,
                                  alpha, blk);
        });
    });
}

void dsd_t(const Problem& p, const float* vals, const float* b, float* out, float alpha, int threads) {
    check_problem(p);
    const int64_t blk = p.blk, blk2 = blk * blk;
    dispatch_block(blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            const Unit w = unit_of(p, u);
            const int64_t e0 = p.col_ptr[w.h * p.nb + w.x], e1 = p.col_ptr[w.h * p.nb + w.x + 1];
            Scratch& s = scratch();
            s.lists(size_t(e1 - e0));
            for (int64_t e = e0; e < e1; ++e) {
                s.p1[e - e0] = vals + (w.b * p.nnz + p.col_ids[e]) * blk2;
                s.p2[e - e0] = b + (w.bh * p.S + p.col_rows[e] * blk) * p.D;
            }
            tiles_spmm<BT, true>(e1 - e0, s.p1.data(), s.p2.data(), out + (w.bh * p.S + w.x * blk) * p.D, p.D,
                                 alpha, blk);
        });
    });
}

void softmax_forward(const Problem& p, const SoftmaxTerms& t, float* x, int threads) {
    check_problem(p);
    const int64_t blk = p.blk, blk2 = blk * blk;
    dispatch_block(blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            const Unit w = unit_of(p, u);
            const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1];
            float* tiles = x + (w.b * p.nnz + k0) * blk2;
            for (int64_t k = k0; k < k1; ++k) apply_terms<BT>(tiles + (k - k0) * blk2, p, t, w.b, w.h, w.x, p.cols[k]);
            softmax_tiles<BT>(tiles, k1 - k0, blk, nullptr);
        });
    });
}

void softmax_backward(const Problem& p, const float* prob, float* grad, int threads) {
    check_problem(p);
    const int64_t blk = p.blk, blk2 = blk * blk;
    dispatch_block(blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            const Unit w = unit_of(p, u);
            const int64_t k0 = p.row_ptr[w.h * p.nb + w.x], k1 = p.row_ptr[w.h * p.nb + w.x + 1];
            const int64_t off = (w.b * p.nnz + k0) * blk2;
            float delta_stack[BT ? BT : 1];
            std::vector<float> delta_heap(BT ? 0 : size_t(blk));
            float* delta = BT ? delta_stack : delta_heap.data();
            row_dots<BT>(prob + off, grad + off, k1 - k0, blk, delta);
            for (int64_t e = 0; e < k1 - k0; ++e)
                softmax_grad_rows<BT>(prob + off + e * blk2, grad + off + e * blk2, delta, blk);
        });
    });
}

void attention_forward(const Problem& p, const SoftmaxTerms& t, const float* q, const float* k, const float* v,
                       float* out, float* lse, float* prob, int threads) {
    check_problem(p);
    if (p.B == 0) return;
    auto kt = transposed_blocks(p, k, threads);
    dispatch_block(p.blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        parallel_units(p.B * p.H * p.nb, threads, [&](int64_t u) {
            forward_unit<BT>(p, t, q, kt.get(), v, out, lse, prob, unit_of(p, u));
        });
    });
}

void attention_backward(const Problem& p, const SoftmaxTerms& t, const float* q, const float* k, const float* v,
                        const float* dout, const float* lse, float* dq, float* dk, float* dv, float* grad,
                        int threads) {
    check_problem(p);
    if (p.B == 0) return;
    auto kt = transposed_blocks(p, k, threads);
    auto vt = transposed_blocks(p, v, threads);
    std::unique_ptr<float[]> delta(new float[size_t(p.B * p.H * p.S)]);
    dispatch_block(p.blk, [&](auto bt_c) {
        constexpr int BT = decltype(bt_c)::value;
        const int64_t units = p.B * p.H * p.nb;
        parallel_units(units, threads, [&](int64_t u) {
            backward_row_unit<BT>(p, t, q, k, kt.get(), vt.get(), dout, lse, delta.get(), dq, grad, unit_of(p, u));
        });
        parallel_units(units, threads, [&](int64_t u) {
            backward_col_unit<BT>(p, t, q, kt.get(), vt.get(), dout, lse, delta.get(), dk, dv, unit_of(p, u));
        });
    });
}

int64_t parallel_units_check(int64_t units, int threads, int64_t fail_unit) {
    std::atomic<int64_t> ran{0};
    parallel_units(units, threads, [&](int64_t u) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));  // so that every thread claims units
        if (u == fail_unit) throw std::runtime_error("unit " + std::to_string(u) + " failed");
        ran.fetch_add(1);
    });
    return ran.load();
}

const char* simd_isa() {
#if DSPLUG_SA_VW == 16
    return "avx512";
#elif DSPLUG_SA_VW == 8
    return "avx2";
#else
    return "scalar";
#endif
}

}  // namespace sparse
}  // namespace dsplug
