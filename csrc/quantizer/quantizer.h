// Group-wise fake quantization (quantize, then dequantize) on raw fp32 CPU buffers.
//
// The contract (dsplug.ops.quantize documents it in full; the pure-torch fallback
// there computes the same float32 operations in the same order, so both agree bitwise):
//   x (n floats) is split into `groups` equal contiguous groups. Per group, in float32:
//     symmetric:  qmax = 2^(bits-1) - 1;  scale = max|x| / qmax;           offset = 0
//                 q = clamp(round(x / scale), -qmax, qmax);                out = q * scale
//     asymmetric: L = 2^bits - 1;  lo = min x, hi = max x;  scale = (hi - lo) / L;  offset = lo
//                 q = clamp(round((x - lo) / scale), 0, L);                out = q * scale + lo
//   round is round-half-to-even; stochastic rounding (noise != nullptr) uses floor(t + u) with the
//   caller's u ~ U[0, 1). A group whose scale is 0 is copied unchanged (q = 0). A group holding a
//   NaN or an infinity gets scale = offset = NaN, hence all-NaN output (as torch's ops give).
#pragma once

#include <cstdint>

namespace dsplug {

struct QuantizeArgs {
    const float* x = nullptr;      // n inputs
    float* out = nullptr;          // n dequantized outputs (nullptr: not wanted); may alias x
    const float* noise = nullptr;  // n uniform [0, 1) draws: stochastic rounding (nullptr: nearest)
    void* q = nullptr;             // n codes, int8 (symmetric) or uint8 (asymmetric), bits <= 8 (nullptr: not wanted)
    float* scale = nullptr;        // [groups]: written (compute_scales) or read
    float* offset = nullptr;       // [groups]: written (compute_scales) or read
    int64_t n = 0;
    int64_t groups = 1;
    int bits = 8;
    bool symmetric = true;
};

// Validates the arguments (std::invalid_argument naming the bad value), then either computes each
// group's scale and offset (compute_scales) or uses the given ones, and quantizes.
void quantize_groups(const QuantizeArgs& a, bool compute_scales, int num_threads);

const char* quantizer_isa();

}  // namespace dsplug
