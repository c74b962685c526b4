// SIMD lanes for the CPU optimizer kernels: AVX-512, AVX2 or scalar, chosen at compile time.
//
// The builder compiles with -march=native (or the ISA forced by DSPLUG_OPS_ISA), so the
// macros __AVX512F__ / __AVX2__ describe the machine the module is built for. Defining
// DSPLUG_SIMD_SCALAR forces the portable scalar path (used by tests to check the SIMD path).
//
// Every kernel is written once, as a template over a lane type `V`: `float` (one element) or
// `VecF` (a SIMD register of floats). Arithmetic is in fp32; storage may be fp32, bf16 or fp16.
// Conversions to bf16 / fp16 round to nearest even, like torch's `.to(dtype)`.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(DSPLUG_SIMD_SCALAR) && (defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__))
#include <immintrin.h>
#endif

#if !defined(DSPLUG_SIMD_SCALAR) && defined(__AVX512F__)
#define DSPLUG_SIMD_AVX512 1
#define DSPLUG_SIMD_NAME "avx512"
#elif !defined(DSPLUG_SIMD_SCALAR) && defined(__AVX2__)
#define DSPLUG_SIMD_AVX2 1
#define DSPLUG_SIMD_NAME "avx2"
#else
#define DSPLUG_SIMD_NAME "scalar"
#endif

#if !defined(DSPLUG_SIMD_SCALAR) && defined(__F16C__)
#define DSPLUG_HAVE_F16C 1
#endif

namespace dsplug {

// Storage types. Codes are shared with the Python wrappers (dsplug.ops.native.tensor_args).
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16_t { uint16_t bits; };
struct half_t { uint16_t bits; };
struct NoOutput {};  // "no half-precision copy requested"

// ---------------------------------------------------------------- scalar conversions
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN -> canonical quiet NaN (as torch)
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest, ties to even
    return uint16_t(u >> 16);
}

inline float half_to_float(uint16_t h) {
#if DSPLUG_HAVE_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in fp32
        float mag = float(man) * 5.9604644775390625e-8f;
        return sign ? -mag : mag;
    }
    if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
    return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

inline uint16_t float_to_half(float f) {
#if DSPLUG_HAVE_F16C
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u = float_to_bits(f);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN / inf
    if (a >= 0x477ff000u) return sign | 0x7c00;                                // rounds to inf
    if (a < 0x38800000u) {
        // Below the smallest normal half: adding 0.5 puts the value's bits at the 2^-24 ulp,
        // so the fp32 addition itself rounds to nearest even.
        float r = bits_to_float(a) + 0.5f;
        return sign | uint16_t(float_to_bits(r) - float_to_bits(0.5f));
    }
    const uint32_t odd = (a >> 13) & 1u;
    a += (uint32_t(15 - 127) << 23) + 0xfffu + odd;
    return sign | uint16_t(a >> 13);
#endif
}

// ---------------------------------------------------------------- scalar lanes
template <class V> struct Lanes;

template <> struct Lanes<float> {
    static constexpr int width = 1;
    static float load(const float* p) { return *p; }
    static float load(const bf16_t* p) { return bf16_to_float(p->bits); }
    static float load(const half_t* p) { return half_to_float(p->bits); }
    static void store(float* p, float v) { *p = v; }
    static void store(bf16_t* p, float v) { p->bits = float_to_bf16(v); }
    static void store(half_t* p, float v) { p->bits = float_to_half(v); }
};

inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) && !defined(DSPLUG_SIMD_SCALAR)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}
inline float vsqrt(float a) { return std::sqrt(a); }
inline float vsign(float a) { return a > 0.f ? 1.f : (a < 0.f ? -1.f : 0.f); }

// ---------------------------------------------------------------- AVX-512 lanes
#if DSPLUG_SIMD_AVX512
struct VecF {
    __m512 v;
    VecF() : v(_mm512_setzero_ps()) {}
    VecF(__m512 x) : v(x) {}
    VecF(float x) : v(_mm512_set1_ps(x)) {}
};
inline VecF operator+(VecF a, VecF b) { return _mm512_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm512_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm512_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm512_div_ps(a.v, b.v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
inline VecF vsqrt(VecF a) { return _mm512_sqrt_ps(a.v); }
inline VecF vsign(VecF a) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ), zero, _mm512_set1_ps(1.f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ), r, _mm512_set1_ps(-1.f));
}

template <> struct Lanes<VecF> {
    static constexpr int width = 16;
    static VecF load(const float* p) { return _mm512_loadu_ps(p); }
    static VecF load(const bf16_t* p) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    static VecF load(const half_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static void store(float* p, VecF v) { _mm512_storeu_ps(p, v.v); }
    static void store(bf16_t* p, VecF v) {
        __m512i u = _mm512_castps_si512(v.v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
    }
    static void store(half_t* p, VecF v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
    }
};
#define DSPLUG_HAVE_VECF 1

// ---------------------------------------------------------------- AVX2 lanes
#elif DSPLUG_SIMD_AVX2
struct VecF {
    __m256 v;
    VecF() : v(_mm256_setzero_ps()) {}
    VecF(__m256 x) : v(x) {}
    VecF(float x) : v(_mm256_set1_ps(x)) {}
};
inline VecF operator+(VecF a, VecF b) { return _mm256_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm256_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm256_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm256_div_ps(a.v, b.v); }
inline VecF fmadd(VecF a, VecF b, VecF c) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a.v, b.v, c.v);
#else
    return _mm256_add_ps(_mm256_mul_ps(a.v, b.v), c.v);
#endif
}
inline VecF vsqrt(VecF a) { return _mm256_sqrt_ps(a.v); }
inline VecF vsign(VecF a) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), _mm256_set1_ps(1.f));
    __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), _mm256_set1_ps(1.f));
    return _mm256_sub_ps(pos, neg);
}

template <> struct Lanes<VecF> {
    static constexpr int width = 8;
    static VecF load(const float* p) { return _mm256_loadu_ps(p); }
    static VecF load(const bf16_t* p) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    static VecF load(const half_t* p) {
#if DSPLUG_HAVE_F16C
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
        alignas(32) float tmp[8];
        for (int i = 0; i < 8; ++i) tmp[i] = half_to_float(p[i].bits);
        return _mm256_load_ps(tmp);
#endif
    }
    static void store(float* p, VecF v) { _mm256_storeu_ps(p, v.v); }
    static void store(bf16_t* p, VecF v) {
        __m256i u = _mm256_castps_si256(v.v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        // pack 8 x u32 (all <= 0xffff) into 8 x u16: packus works per 128-bit lane, then fix order
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    }
    static void store(half_t* p, VecF v) {
#if DSPLUG_HAVE_F16C
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
#else
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, v.v);
        for (int i = 0; i < 8; ++i) p[i].bits = float_to_half(tmp[i]);
#endif
    }
};
#define DSPLUG_HAVE_VECF 1
#endif

}  // namespace dsplug
