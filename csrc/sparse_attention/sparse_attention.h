// Block-sparse attention kernels on raw fp32 CPU buffers (the `sparse_attn` op).
//
// Shapes. Dense operands (q, k, v, the output and their gradients) are contiguous
// [B, H, S, D] (batch, head, token, head dim). Block-sparse operands (scores, probabilities and
// their gradients) are contiguous [B, nnz, blk, blk]: one blk x blk tile per nonzero block of the
// layout, nnz counting the nonzero blocks of all heads in (head, block-row, block-col) order, the
// order of `layout.nonzero()`. The layout arrives as CSR and CSC indexes (see Problem).
//
// Building blocks (every product in fp32):
//   sdd      C[b,k]  = A_(h,r) . B_(h,c)^T                   for each nonzero block k = (h, r, c)
//   dsd      O_(h,r) = alpha * sum_k  C[b,k] . B_(h,c)         over the blocks of block-row r
//   dsd_t    O_(h,c) = alpha * sum_k  C[b,k]^T . B_(h,r)       over the blocks of block-column c
//   softmax_forward  x = scale * C + rpe + key_padding + attn_mask (-inf where col > row when
//                    causal), then a softmax along each token row over the row's nonzero blocks;
//                    a row with no finite entry becomes all zeros
//   softmax_backward G := P * (G - rowsum(P * G))             (the gradient w.r.t. x)
//
// Fused attention (what the autograd function runs), memory-efficient like flash attention:
//   attention_forward   P = softmax_forward(sdd(q, k)) one block-row at a time in a per-thread
//                       buffer, out = dsd(P, v), lse[b,h,i] = log(sum_j exp(x_ij)) (+inf for a
//                       row with no finite entry); P is written to `prob` only when given.
//   attention_backward  recomputes P = exp(x - lse) per tile:
//                       by block-row:    dP = dout . v^T,  delta_i = rowsum(P * dP),
//                                        G = P * (dP - delta),  dq = scale * G . k
//                       by block-column: dv = P^T . dout,  dk = scale * G^T . q
//                       (G is written to `grad` [B, nnz, blk, blk] when given: the gradient
//                       w.r.t. x, e.g. for a relative position embedding that needs one).
//   No [B, nnz, blk, blk] buffer is needed: memory is O(B * H * S * D) plus one block-row (or
//   block-column) of tiles per thread.
//
// Work is split over (batch, head, block-row) -- or block-column -- units that the calling
// thread and num_threads - 1 workers claim from a shared counter; no two units write the same
// memory, so results do not depend on the thread count.
#pragma once

#include <cstdint>

namespace dsplug {
namespace sparse {

struct Problem {
    int64_t B = 0, H = 0, S = 0, D = 0;  // batch, heads, tokens, head dim
    int64_t blk = 0, nb = 0, nnz = 0;    // block size, blocks per row (S / blk), nonzero blocks (all heads)
    const int64_t* row_ptr = nullptr;   // [H*nb + 1] blocks of block-row (h, r): row_ptr[h*nb+r] .. row_ptr[h*nb+r+1]
    const int64_t* cols = nullptr;      // [nnz] block-column of each block (CSR order = value order)
    const int64_t* col_ptr = nullptr;   // [H*nb + 1] CSC pointers of block-column (h, c)
    const int64_t* col_rows = nullptr;  // [nnz] block-row of each CSC entry (ascending within a column)
    const int64_t* col_ids = nullptr;   // [nnz] value index of each CSC entry
};

struct SoftmaxTerms {
    float scale = 1.f;
    const float* rpe = nullptr;  // rpe[b*rpe_sb + h*rpe_sh + row*S + col] (strides 0 broadcast)
    int64_t rpe_sb = 0, rpe_sh = 0;
    const float* kp = nullptr;   // additive key-padding mask kp[b*kp_sb + col]
    int64_t kp_sb = 0;
    const float* am = nullptr;   // additive attention mask am[row*S + col]
    bool causal = false;         // col > row is masked (-inf)
};

void check_problem(const Problem& p);
void sdd(const Problem& p, const float* a, const float* b, float* out, int threads);
void dsd(const Problem& p, const float* vals, const float* b, float* out, float alpha, int threads);
void dsd_t(const Problem& p, const float* vals, const float* b, float* out, float alpha, int threads);
void softmax_forward(const Problem& p, const SoftmaxTerms& t, float* x, int threads);
void softmax_backward(const Problem& p, const float* prob, float* grad, int threads);
void attention_forward(const Problem& p, const SoftmaxTerms& t, const float* q, const float* k, const float* v,
                       float* out, float* lse, float* prob, int threads);
void attention_backward(const Problem& p, const SoftmaxTerms& t, const float* q, const float* k, const float* v,
                        const float* dout, const float* lse, float* dq, float* dk, float* dv, float* grad,
                        int threads);
// Self-test of the thread pool (for the tests): runs `units` units on `threads` threads where unit
// `fail_unit` (-1: none) throws std::runtime_error; returns how many units ran, or rethrows.
int64_t parallel_units_check(int64_t units, int threads, int64_t fail_unit);
const char* simd_isa();

}  // namespace sparse
}  // namespace dsplug
