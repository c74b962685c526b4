// Python bindings of the sparse_attn op (kernels: sparse_attention.cpp; contract: sparse_attention.h).
// Raw buffer addresses come from the Python wrapper (dsplug.ops.sparse_attention), which checks
// shapes, dtypes and contiguity; the GIL is released while a kernel runs.
#include "sparse_attention.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace pybind11::literals;
using dsplug::sparse::Problem;
using dsplug::sparse::SoftmaxTerms;

namespace {

// geom = (B, H, S, D, blk, nb, nnz); index = (row_ptr, cols, col_ptr, col_rows, col_ids) pointers
Problem make_problem(const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index) {
    if (geom.size() != 7) throw std::invalid_argument("sparse_attn: geom must be (B, H, S, D, blk, nb, nnz)");
    if (index.size() != 5) throw std::invalid_argument("sparse_attn: index must hold 5 pointers");
    Problem p;
    p.B = geom[0];
    p.H = geom[1];
    p.S = geom[2];
    p.D = geom[3];
    p.blk = geom[4];
    p.nb = geom[5];
    p.nnz = geom[6];
    p.row_ptr = reinterpret_cast<const int64_t*>(index[0]);
    p.cols = reinterpret_cast<const int64_t*>(index[1]);
    p.col_ptr = reinterpret_cast<const int64_t*>(index[2]);
    p.col_rows = reinterpret_cast<const int64_t*>(index[3]);
    p.col_ids = reinterpret_cast<const int64_t*>(index[4]);
    return p;
}

// terms = (scale, rpe, rpe_sb, rpe_sh, kp, kp_sb, am, causal); pointers 0 = absent
SoftmaxTerms make_terms(const py::tuple& terms) {
    if (terms.size() != 8) throw std::invalid_argument("sparse_attn: softmax terms must have 8 entries");
    SoftmaxTerms t;
    t.scale = terms[0].cast<float>();
    t.rpe = reinterpret_cast<const float*>(terms[1].cast<uintptr_t>());
    t.rpe_sb = terms[2].cast<int64_t>();
    t.rpe_sh = terms[3].cast<int64_t>();
    t.kp = reinterpret_cast<const float*>(terms[4].cast<uintptr_t>());
    t.kp_sb = terms[5].cast<int64_t>();
    t.am = reinterpret_cast<const float*>(terms[6].cast<uintptr_t>());
    t.causal = terms[7].cast<bool>();
    return t;
}

template <class T>
T* ptr(uintptr_t p) {
    return reinterpret_cast<T*>(p);
}

}  // namespace

PYBIND11_MODULE(DSPLUG_EXT_NAME, m) {
    m.doc() = "dsplug sparse_attn op: block-sparse SDDMM / softmax / SpMM for attention on fp32 CPU buffers";
    m.def("simd_isa", [] { return std::string(dsplug::sparse::simd_isa()); },
          "vector width the kernels were built for (avx512: 16 floats, avx2: 8, scalar: 4-float generic vectors)");
    m.def(
        "_parallel_units_check",
        [](int64_t units, int threads, int64_t fail_unit) {
            py::gil_scoped_release release;
            return dsplug::sparse::parallel_units_check(units, threads, fail_unit);
        },
        "units"_a, "threads"_a, "fail_unit"_a,
        "self-test of the thread pool: runs `units` units on `threads` threads, unit `fail_unit` (-1: none) "
        "throws; returns how many units ran (raises RuntimeError from the failing unit)");
    m.def(
        "sdd",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, uintptr_t a, uintptr_t b,
           uintptr_t out, int threads) {
            const Problem p = make_problem(geom, index);
            py::gil_scoped_release release;
            dsplug::sparse::sdd(p, ptr<const float>(a), ptr<const float>(b), ptr<float>(out), threads);
        },
        "geom"_a, "index"_a, "a"_a, "b"_a, "out"_a, "threads"_a, "out[b,k] = a_(h,r) . b_(h,c)^T on the nonzero blocks");
    m.def(
        "dsd",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, uintptr_t vals, uintptr_t b,
           uintptr_t out, float alpha, int threads) {
            const Problem p = make_problem(geom, index);
            py::gil_scoped_release release;
            dsplug::sparse::dsd(p, ptr<const float>(vals), ptr<const float>(b), ptr<float>(out), alpha, threads);
        },
        "geom"_a, "index"_a, "vals"_a, "b"_a, "out"_a, "alpha"_a, "threads"_a,
        "out_(h,r) = alpha * sum_k vals[b,k] . b_(h,c) (every row written)");
    m.def(
        "dsd_t",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, uintptr_t vals, uintptr_t b,
           uintptr_t out, float alpha, int threads) {
            const Problem p = make_problem(geom, index);
            py::gil_scoped_release release;
            dsplug::sparse::dsd_t(p, ptr<const float>(vals), ptr<const float>(b), ptr<float>(out), alpha, threads);
        },
        "geom"_a, "index"_a, "vals"_a, "b"_a, "out"_a, "alpha"_a, "threads"_a,
        "out_(h,c) = alpha * sum_k vals[b,k]^T . b_(h,r) (every row written)");
    m.def(
        "softmax_forward",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, const py::tuple& terms,
           uintptr_t x, int threads) {
            const Problem p = make_problem(geom, index);
            const SoftmaxTerms t = make_terms(terms);
            py::gil_scoped_release release;
            dsplug::sparse::softmax_forward(p, t, ptr<float>(x), threads);
        },
        "geom"_a, "index"_a, "terms"_a, "x"_a, "threads"_a, "in place: x <- softmax(scale * x + rpe + masks)");
    m.def(
        "softmax_backward",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, uintptr_t prob, uintptr_t grad,
           int threads) {
            const Problem p = make_problem(geom, index);
            py::gil_scoped_release release;
            dsplug::sparse::softmax_backward(p, ptr<const float>(prob), ptr<float>(grad), threads);
        },
        "geom"_a, "index"_a, "prob"_a, "grad"_a, "threads"_a, "in place: grad <- prob * (grad - rowsum(prob * grad))");
    m.def(
        "attention_forward",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, const py::tuple& terms,
           uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, uintptr_t prob, int threads) {
            const Problem p = make_problem(geom, index);
            const SoftmaxTerms t = make_terms(terms);
            py::gil_scoped_release release;
            dsplug::sparse::attention_forward(p, t, ptr<const float>(q), ptr<const float>(k), ptr<const float>(v),
                                              ptr<float>(out), ptr<float>(lse), ptr<float>(prob), threads);
        },
        "geom"_a, "index"_a, "terms"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "prob"_a, "threads"_a,
        "out = softmax(scores) . v per block-row; lse [B, H, S] (0: not wanted); prob [B, nnz, blk, blk] "
        "(0: not stored)");
    m.def(
        "attention_backward",
        [](const std::vector<int64_t>& geom, const std::vector<uintptr_t>& index, const py::tuple& terms,
           uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t dout, uintptr_t lse, uintptr_t dq, uintptr_t dk,
           uintptr_t dv, uintptr_t grad, int threads) {
            const Problem p = make_problem(geom, index);
            const SoftmaxTerms t = make_terms(terms);
            py::gil_scoped_release release;
            dsplug::sparse::attention_backward(p, t, ptr<const float>(q), ptr<const float>(k), ptr<const float>(v),
                                               ptr<const float>(dout), ptr<const float>(lse), ptr<float>(dq),
                                               ptr<float>(dk), ptr<float>(dv), ptr<float>(grad), threads);
        },
        "geom"_a, "index"_a, "terms"_a, "q"_a, "k"_a, "v"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a, "grad"_a,
        "threads"_a, "gradients of attention_forward from its lse; grad [B, nnz, blk, blk] (0: not wanted) receives "
        "the gradient w.r.t. the masked scores");
}
