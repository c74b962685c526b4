// Shared driver of the CPU optimizer kernels (Adam, Adagrad, Lion).
//
// An update rule `U` is a struct with `kStates` (1 or 2 moment buffers), a `Consts` struct of
// fp32 constants for one step, and `Step<V>`: those constants broadcast to lane type V (see
// dsplug_simd.h) with `operator()(param, grad, states...)` applying the rule, written once for
// every V. The driver builds each Step once per chunk, so the constants stay in registers. The driver makes one pass over memory: each element's
// parameter, gradient and moments are loaded once, updated in registers, and stored once,
// together with the optional lower-precision copy of the new parameter.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "dsplug_omp_team.h"
#include "dsplug_simd.h"

namespace dsplug {

struct OptimizerBuffers {
    uintptr_t param = 0;   // P*        updated in place
    uintptr_t grad = 0;    // const P*
    uintptr_t state1 = 0;  // S*        exp_avg (Adam, Lion) or sum of squares (Adagrad)
    uintptr_t state2 = 0;  // S*        exp_avg_sq (Adam only)
    uintptr_t out = 0;     // O*        optional copy of the updated parameter (0: none)
    int64_t n = 0;
    int param_dtype = kFloat32;  // also the gradient's dtype
    int state_dtype = kFloat32;
    int out_dtype = kBFloat16;
};

// Runs fn(begin, end) over [0, n) split into one contiguous chunk per thread, on the OpenMP team
// torch's kernels use when there is one (dsplug_omp_team.h says why), else on threads started
// here. Small ranges run on the calling thread: starting a thread costs more than updating a few
// thousand elements. fn must not throw.
template <class Fn>
void parallel_for(int64_t n, int num_threads, const Fn& fn) {
    constexpr int64_t kMinPerThread = int64_t(1) << 15;
    constexpr int64_t kAlign = 64;  // chunk starts stay on cache lines and SIMD boundaries
    int64_t threads = std::min<int64_t>(std::max(num_threads, 1), (n + kMinPerThread - 1) / kMinPerThread);
    if (threads <= 1) {
        fn(int64_t(0), n);
        return;
    }
    auto chunk_of = [n](int64_t count) {
        int64_t chunk = (n + count - 1) / count;
        return (chunk + kAlign - 1) / kAlign * kAlign;
    };
    const bool on_team = run_on_omp_team(int(threads), [&](int index, int count) {
        const int64_t chunk = chunk_of(count);  // the team may give fewer threads than asked
        const int64_t begin = index * chunk;
        if (begin < n) fn(begin, std::min(n, begin + chunk));
    });
    if (on_team) return;
    const int64_t chunk = chunk_of(threads);
    std::vector<std::thread> workers;
    workers.reserve(size_t(threads));
    for (int64_t t = 1; t < threads; ++t) {
        int64_t begin = t * chunk;
        if (begin >= n) break;
        workers.emplace_back([&fn, begin, end = std::min(n, begin + chunk)] { fn(begin, end); });
    }
    fn(int64_t(0), std::min(n, chunk));
    for (auto& w : workers) w.join();
}

template <class U, class V, class P, class S, class O>
inline void step_at(P* p, const P* g, S* s1, S* s2, O* o, int64_t i, const typename U::template Step<V>& rule) {
    using L = Lanes<V>;
    V pv = L::load(p + i);
    V gv = L::load(g + i);
    V a = L::load(s1 + i);
    if constexpr (U::kStates == 2) {
        V b = L::load(s2 + i);
        rule(pv, gv, a, b);
        L::store(s2 + i, b);
    } else {
        rule(pv, gv, a);
    }
    L::store(s1 + i, a);
    L::store(p + i, pv);
    if constexpr (!std::is_same<O, NoOutput>::value) L::store(o + i, pv);
}

template <class U, class P, class S, class O>
void run_range(const OptimizerBuffers& b, const typename U::Consts& c, int64_t begin, int64_t end) {
    P* p = reinterpret_cast<P*>(b.param);
    const P* g = reinterpret_cast<const P*>(b.grad);
    S* s1 = reinterpret_cast<S*>(b.state1);
    S* s2 = reinterpret_cast<S*>(b.state2);
    O* o = reinterpret_cast<O*>(b.out);
    int64_t i = begin;
#if DSPLUG_HAVE_VECF
    const typename U::template Step<VecF> vector_rule(c);
    for (; i + Lanes<VecF>::width <= end; i += Lanes<VecF>::width) step_at<U, VecF>(p, g, s1, s2, o, i, vector_rule);
#endif
    const typename U::template Step<float> scalar_rule(c);
    for (; i < end; ++i) step_at<U, float>(p, g, s1, s2, o, i, scalar_rule);  // tail (or all, when scalar)
}

template <class U, class P, class S, class O>
void run_typed(const OptimizerBuffers& b, const typename U::Consts& c, int threads) {
    parallel_for(b.n, threads, [&](int64_t begin, int64_t end) { run_range<U, P, S, O>(b, c, begin, end); });
}

// The storage combinations the kernels are instantiated for (each costs compile time):
//   fp32 params: fp32 or bf16 moments, optional fp32 / bf16 / fp16 copy of the new params
//   bf16 params: fp32 or bf16 moments;  fp16 params: fp32 or fp16 moments.
// Gradients have the parameters' dtype. The Python wrappers check this before calling.
constexpr int kNoOut = -1;

template <class U>
void run_optimizer(const OptimizerBuffers& b, const typename U::Consts& c, int threads) {
    if (b.n <= 0) return;
    const int p = b.param_dtype, s = b.state_dtype, o = b.out ? b.out_dtype : kNoOut;
#define DSPLUG_COMBO(P, S, O, PT, ST, OT) \
    if (p == P && s == S && o == O) return run_typed<U, PT, ST, OT>(b, c, threads);
    DSPLUG_COMBO(kFloat32, kFloat32, kNoOut, float, float, NoOutput)
    DSPLUG_COMBO(kFloat32, kFloat32, kBFloat16, float, float, bf16_t)
    DSPLUG_COMBO(kFloat32, kFloat32, kFloat16, float, float, half_t)
    DSPLUG_COMBO(kFloat32, kFloat32, kFloat32, float, float, float)
    DSPLUG_COMBO(kFloat32, kBFloat16, kNoOut, float, bf16_t, NoOutput)
    DSPLUG_COMBO(kFloat32, kBFloat16, kBFloat16, float, bf16_t, bf16_t)
    DSPLUG_COMBO(kFloat32, kBFloat16, kFloat16, float, bf16_t, half_t)
    DSPLUG_COMBO(kBFloat16, kFloat32, kNoOut, bf16_t, float, NoOutput)
    DSPLUG_COMBO(kBFloat16, kBFloat16, kNoOut, bf16_t, bf16_t, NoOutput)
    DSPLUG_COMBO(kFloat16, kFloat32, kNoOut, half_t, float, NoOutput)
    DSPLUG_COMBO(kFloat16, kFloat16, kNoOut, half_t, half_t, NoOutput)
#undef DSPLUG_COMBO
    throw std::invalid_argument("unsupported dtype combination: param " + std::to_string(p) + ", state " +
                                std::to_string(s) + ", output copy " + std::to_string(o) +
                                " (codes: 0=float32, 1=bfloat16, 2=float16, -1=none)");
}

inline const char* simd_isa() { return DSPLUG_SIMD_NAME; }

}  // namespace dsplug
