// The quantizer op: group-wise fake quantization kernels (see quantizer.h for the formulas) and
// their Python bindings. Arguments are raw data pointers (ints) of contiguous fp32 / int8 / uint8
// CPU tensors that the Python wrapper (dsplug.ops.quantize) allocated and checked;
// each call releases the GIL for its whole duration.
//
// Work split: with many groups (or small ones) a unit of work is a run of whole groups, each
// given both passes (statistics, then quantize) while it is still in cache; with a few large
// groups a unit is a run of elements: partial statistics per unit are combined (min / max are
// exact, so the result does not depend on the split), then a second parallel pass quantizes.
// Every element goes through the same float32 operations in the SIMD and scalar paths: IEEE
// division (no reciprocal), separate multiply and add (built with -ffp-contract=off), rounding
// by the instruction set's round-to-nearest-even / floor.
#include "quantizer.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dsplug_parallel_units.h"
#include "dsplug_simd.h"

namespace dsplug {
namespace {

constexpr int64_t kMinPerThread = int64_t(1) << 15;  // smaller ranges are not worth a thread
constexpr int64_t kUnit = int64_t(1) << 16;           // elements per unit of work (256 KiB of fp32)

// ------------------------------------------------------------------ lanes
// clamp(t) = min(hi, max(lo, t)) with these operand orders returns t when t is NaN (the x86
// min/max instructions return their second operand on NaN), exactly as torch.clamp does.
#if DSPLUG_SIMD_AVX512
#define DSPLUG_QUANT_SIMD 1
struct Simd {
    using V = __m512;
    static constexpr int W = 16;
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V set1(float f) { return _mm512_set1_ps(f); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V min(V a, V b) { return _mm512_min_ps(a, b); }
    static V abs(V a) { return _mm512_abs_ps(a); }
    static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
    static void store_i32(int32_t* p, V v) { _mm512_storeu_si512(p, _mm512_cvtps_epi32(v)); }
};
#elif DSPLUG_SIMD_AVX2
#define DSPLUG_QUANT_SIMD 1
struct Simd {
    using V = __m256;
    static constexpr int W = 8;
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V set1(float f) { return _mm256_set1_ps(f); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V min(V a, V b) { return _mm256_min_ps(a, b); }
    static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
    static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static V floor(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
    static void store_i32(int32_t* p, V v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_cvtps_epi32(v));
    }
};
#endif

#if DSPLUG_QUANT_SIMD
template <class Op>
inline float horizontal(Simd::V v, float init, Op op) {
    alignas(64) float lanes[Simd::W];
    Simd::store(lanes, v);
    float r = init;
    for (int k = 0; k < Simd::W; ++k) r = op(r, lanes[k]);
    return r;
}
#endif

// ------------------------------------------------------------------ statistics
struct Stats {
    float a = 0.f;  // symmetric: max |x|;  asymmetric: min x
    float b = -std::numeric_limits<float>::infinity();  // asymmetric: max x
    float bad = 0.f;  // sum of (x - x): 0 when every value is finite, NaN otherwise

    static Stats identity(bool symmetric) {
        Stats s;
        if (!symmetric) s.a = std::numeric_limits<float>::infinity();
        return s;
    }
    void merge(const Stats& o, bool symmetric) {
        a = symmetric ? std::max(a, o.a) : std::min(a, o.a);
        b = std::max(b, o.b);
        bad += o.bad;
    }
};

Stats stats_range(const float* x, int64_t begin, int64_t end, bool symmetric) {
    Stats s = Stats::identity(symmetric);
    int64_t i = begin;
#if DSPLUG_QUANT_SIMD
    if (end - begin >= Simd::W) {
        Simd::V va = Simd::set1(s.a), vb = Simd::set1(s.b), bad = Simd::set1(0.f);
        if (symmetric) {
            for (; i + Simd::W <= end; i += Simd::W) {
                Simd::V v = Simd::load(x + i);
                va = Simd::max(va, Simd::abs(v));
                bad = Simd::add(bad, Simd::sub(v, v));
            }
        } else {
            for (; i + Simd::W <= end; i += Simd::W) {
                Simd::V v = Simd::load(x + i);
                va = Simd::min(va, v);
                vb = Simd::max(vb, v);
                bad = Simd::add(bad, Simd::sub(v, v));
            }
        }
        s.a = symmetric ? horizontal(va, s.a, [](float p, float q) { return std::max(p, q); })
                        : horizontal(va, s.a, [](float p, float q) { return std::min(p, q); });
        s.b = horizontal(vb, s.b, [](float p, float q) { return std::max(p, q); });
        s.bad = horizontal(bad, 0.f, [](float p, float q) { return p + q; });
    }
#endif
    for (; i < end; ++i) {
        const float v = x[i];
        if (symmetric) {
            s.a = std::max(s.a, std::fabs(v));
        } else {
            s.a = std::min(s.a, v);
            s.b = std::max(s.b, v);
        }
        s.bad += v - v;
    }
    return s;
}

inline float qmax_of(int bits, bool symmetric) {
    return symmetric ? float((int64_t(1) << (bits - 1)) - 1) : float((int64_t(1) << bits) - 1);
}

void scale_of(const Stats& s, int bits, bool symmetric, float* scale, float* offset) {
    if (s.bad != 0.f || s.bad != s.bad) {  // a NaN or an infinity: the whole group is NaN (as in torch)
        *scale = *offset = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    const float levels = qmax_of(bits, symmetric);
    if (symmetric) {
        *scale = s.a / levels;
        *offset = 0.f;
    } else {
        const float range = s.b - s.a;
        *scale = range / levels;
        *offset = s.a;
    }
}

// ------------------------------------------------------------------ quantize
template <class T>
inline void store_codes(void* q, int64_t i, const int32_t* codes, int count) {
    T* dst = static_cast<T*>(q) + i;
    for (int k = 0; k < count; ++k) dst[k] = static_cast<T>(codes[k]);
}

inline void store_code(const QuantizeArgs& a, int64_t i, float t) {
    const int32_t c = static_cast<int32_t>(t);  // t is an integer in range (inputs are finite)
    if (a.symmetric) static_cast<int8_t*>(a.q)[i] = static_cast<int8_t>(c);
    else static_cast<uint8_t*>(a.q)[i] = static_cast<uint8_t>(c);
}

template <bool Symmetric, bool Stochastic>
void apply_range_t(const QuantizeArgs& a, int64_t group, int64_t begin, int64_t end) {
    const float s = a.scale[group];
    const float lo = a.offset[group];
    const float qhi = qmax_of(a.bits, Symmetric);
    const float qlo = Symmetric ? -qhi : 0.f;
    const float* x = a.x;
    float* out = a.out;
    if (s == 0.f) {  // constant group: unchanged
        if (out && out != x) std::memmove(out + begin, x + begin, size_t(end - begin) * sizeof(float));
        if (a.q) std::memset(static_cast<int8_t*>(a.q) + begin, 0, size_t(end - begin));
        return;
    }
    int64_t i = begin;
#if DSPLUG_QUANT_SIMD
    {
        const Simd::V vs = Simd::set1(s), vlo = Simd::set1(lo), vqlo = Simd::set1(qlo), vqhi = Simd::set1(qhi);
        alignas(64) int32_t codes[Simd::W];
        for (; i + Simd::W <= end; i += Simd::W) {
            Simd::V t = Simd::load(x + i);
            if (!Symmetric) t = Simd::sub(t, vlo);
            t = Simd::div(t, vs);
            t = Stochastic ? Simd::floor(Simd::add(t, Simd::load(a.noise + i))) : Simd::round(t);
            t = Simd::min(vqhi, Simd::max(vqlo, t));
            if (out) {
                Simd::V o = Simd::mul(t, vs);
                if (!Symmetric) o = Simd::add(o, vlo);
                Simd::store(out + i, o);
            }
            if (a.q) {
                Simd::store_i32(codes, t);
                if (Symmetric) store_codes<int8_t>(a.q, i, codes, Simd::W);
                else store_codes<uint8_t>(a.q, i, codes, Simd::W);
            }
        }
    }
#endif
    for (; i < end; ++i) {
        float t = x[i];
        if (!Symmetric) t = t - lo;
        t = t / s;
        t = Stochastic ? std::floor(t + a.noise[i]) : std::nearbyint(t);
        t = qlo > t ? qlo : t;  // NaN stays NaN
        t = qhi < t ? qhi : t;
        if (out) {
            float o = t * s;
            if (!Symmetric) o = o + lo;
            out[i] = o;
        }
        if (a.q) store_code(a, i, t);
    }
}

void apply_range(const QuantizeArgs& a, int64_t group, int64_t begin, int64_t end) {
    if (begin >= end) return;
    const bool stochastic = a.noise != nullptr;
    if (a.symmetric && stochastic) apply_range_t<true, true>(a, group, begin, end);
    else if (a.symmetric) apply_range_t<true, false>(a, group, begin, end);
    else if (stochastic) apply_range_t<false, true>(a, group, begin, end);
    else apply_range_t<false, false>(a, group, begin, end);
}

// Quantizes [begin, end), which may span several groups.
void apply_elements(const QuantizeArgs& a, int64_t group_size, int64_t begin, int64_t end) {
    while (begin < end) {
        const int64_t g = begin / group_size;
        const int64_t stop = std::min(end, (g + 1) * group_size);
        apply_range(a, g, begin, stop);
        begin = stop;
    }
}

// ------------------------------------------------------------------ threads
// Work is cut into units (~kUnit elements) that the calling thread and num_threads - 1 workers
// claim from a shared counter (dsplug_parallel_units.h).

void check_args(const QuantizeArgs& a, bool compute_scales) {
    if (a.n < 0) throw std::invalid_argument("n must be >= 0, got " + std::to_string(a.n));
    if (a.groups < 1) throw std::invalid_argument("groups must be >= 1, got " + std::to_string(a.groups));
    if (a.n % a.groups != 0)
        throw std::invalid_argument("x has " + std::to_string(a.n) + " elements, which do not split into groups=" +
                                    std::to_string(a.groups) + " equal groups");
    const int min_bits = a.symmetric ? 2 : 1;
    if (a.bits < min_bits || a.bits > 16)
        throw std::invalid_argument("bits must be in [" + std::to_string(min_bits) + ", 16] for " +
                                    (a.symmetric ? "symmetric" : "asymmetric") + " quantization, got " +
                                    std::to_string(a.bits));
    if (a.q && a.bits > 8)
        throw std::invalid_argument("integer codes need bits <= 8, got " + std::to_string(a.bits));
    if (a.n > 0 && (!a.x || !a.scale || !a.offset)) throw std::invalid_argument("x, scale and offset are required");
    if (!compute_scales && !a.scale) throw std::invalid_argument("scale is required");
}

}  // namespace

void quantize_groups(const QuantizeArgs& a, bool compute_scales, int num_threads) {
    check_args(a, compute_scales);
    if (a.n == 0) return;
    const int64_t n = a.n, groups = a.groups, group_size = n / groups;
    const int64_t threads =
        std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), (n + kMinPerThread - 1) / kMinPerThread));

    if (compute_scales && (threads == 1 || groups >= 4 * threads || group_size < kMinPerThread)) {
        // units of whole groups: statistics, then quantize while the group is in cache
        const int64_t per_unit = std::max<int64_t>(1, kUnit / group_size);
        parallel_units((groups + per_unit - 1) / per_unit, threads, [&](int64_t u) {
            const int64_t g1 = std::min(groups, (u + 1) * per_unit);
            for (int64_t g = u * per_unit; g < g1; ++g) {
                const int64_t begin = g * group_size, end = begin + group_size;
                scale_of(stats_range(a.x, begin, end, a.symmetric), a.bits, a.symmetric, a.scale + g, a.offset + g);
                apply_range(a, g, begin, end);
            }
        });
        return;
    }

    // a few large groups (or given scales): units of kUnit elements
    const int64_t units = (n + kUnit - 1) / kUnit;
    if (compute_scales) {
        std::vector<Stats> partial(size_t(units * groups), Stats::identity(a.symmetric));
        parallel_units(units, threads, [&](int64_t u) {
            int64_t begin = u * kUnit;
            const int64_t end = std::min(n, begin + kUnit);
            while (begin < end) {
                const int64_t g = begin / group_size;
                const int64_t stop = std::min(end, (g + 1) * group_size);
                partial[size_t(u * groups + g)] = stats_range(a.x, begin, stop, a.symmetric);
                begin = stop;
            }
        });
        for (int64_t g = 0; g < groups; ++g) {
            Stats s = Stats::identity(a.symmetric);
            for (int64_t u = 0; u < units; ++u) s.merge(partial[size_t(u * groups + g)], a.symmetric);
            scale_of(s, a.bits, a.symmetric, a.scale + g, a.offset + g);
        }
    }
    parallel_units(units, threads, [&](int64_t u) {
        const int64_t begin = u * kUnit;
        apply_elements(a, group_size, begin, std::min(n, begin + kUnit));
    });
}

const char* quantizer_isa() { return DSPLUG_SIMD_NAME; }

}  // namespace dsplug

// ------------------------------------------------------------------ bindings
namespace py = pybind11;
using namespace pybind11::literals;

static void quantize_py(uintptr_t x, uintptr_t out, uintptr_t noise, uintptr_t q, uintptr_t scale, uintptr_t offset,
                        int64_t n, int64_t groups, int bits, bool symmetric, bool compute_scales, int num_threads) {
    dsplug::QuantizeArgs a;
    a.x = reinterpret_cast<const float*>(x);
    a.out = reinterpret_cast<float*>(out);
    a.noise = reinterpret_cast<const float*>(noise);
    a.q = reinterpret_cast<void*>(q);
    a.scale = reinterpret_cast<float*>(scale);
    a.offset = reinterpret_cast<float*>(offset);
    a.n = n;
    a.groups = groups;
    a.bits = bits;
    a.symmetric = symmetric;
    dsplug::quantize_groups(a, compute_scales, num_threads);
}

PYBIND11_MODULE(DSPLUG_EXT_NAME, m) {
    m.doc() = "dsplug quantizer op: group-wise (fake) quantization of fp32 CPU buffers, SIMD and multithreaded";
    m.def("simd_isa", [] { return std::string(dsplug::quantizer_isa()); },
          "instruction set the kernels were built for");
    m.def("quantize", &quantize_py, py::call_guard<py::gil_scoped_release>(), "x"_a, "out"_a, "noise"_a, "q"_a,
          "scale"_a, "offset"_a, "n"_a, "groups"_a, "bits"_a, "symmetric"_a, "compute_scales"_a, "num_threads"_a,
          "Quantize n floats at x in `groups` groups: writes the dequantized values to out (0: none), the codes "
          "to q (0: none), and the groups' scale / offset (compute_scales) or reads them. noise (0: nearest "
          "rounding) holds n uniform [0, 1) draws for stochastic rounding.");
}
