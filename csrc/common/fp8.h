// fp8 e4m3 ("fn": no infinities, max 448, NaN = 0x7F) quantization used by dispatch, shared
// by host and device so CPU tests can check the conversion bit for bit against torch.
//
// Scales follow vLLM's dynamic activation quantization:
//   1x128 blocks : s = max(amax, 1e-10) / 448,          q = sat(x / s)
//                  (UE8M0 variant: s rounded up to a power of two, as vLLM does when its
//                  DeepGEMM E8M0 scales are on)
//   per token    : s = max(amax / 448, 1 / (448 * 512)), q = sat(x * (1 / s))
// with sat = clamp to [-448, 448] in fp32, then round to nearest even.
// NaN and infinity follow vLLM's native quantizer (QuantFP8.forward_native and
// _quantize_group_native, plain torch: amax and clamp propagate NaN): a NaN element makes its
// block's (token's) amax and scale NaN, so the whole block arrives as NaN; an infinite element
// makes the scale infinite, the element NaN (inf / inf) and the block's finite elements 0 --
// dequantized, every element of such a block is NaN (never a finite value standing in for the
// NaN, nor an infinity of the wrong sign). tests/test_fp8_nan_inf_cpu.py checks this against
// vLLM's own code.
#pragma once

#include "common/layout.h"

namespace petit {

constexpr float kFp8E4m3Max = 448.0f;
constexpr float kFp8BlockMinAmax = 1e-10f;         // vLLM per_token_group_quant eps
constexpr float kFp8TokenMinScale = 1.0f / (448.0f * 512.0f);  // vLLM per-token minimum

PETIT_HOST_DEVICE uint32_t petit_float_bits(float f) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

PETIT_HOST_DEVICE float petit_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

// max(a, b) that propagates NaN (fmaxf drops it), as torch's amax does.
PETIT_HOST_DEVICE float petit_fmax_nan(float a, float b) {
  return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
}

// clamp(q, -448, 448) that keeps NaN (fminf/fmaxf would turn it into a bound), as torch's
// clamp does.
PETIT_HOST_DEVICE float petit_fp8_clamp(float q) {
  return (q != q) ? q : (q < -kFp8E4m3Max ? -kFp8E4m3Max : (q > kFp8E4m3Max ? kFp8E4m3Max : q));
}

// The smallest power of two >= y (y positive, normal): the UE8M0 scale vLLM uses with
// DeepGEMM (2^ceil(log2 y)), computed exactly on the bits. NaN and infinity stay as they are.
PETIT_HOST_DEVICE float petit_pow2_ceil(float y) {
  const uint32_t bits = petit_float_bits(y);
  if ((bits & 0x7fffffu) == 0 || (bits & 0x7f800000u) == 0x7f800000u) return y;
  return petit_bits_float((bits & 0x7f800000u) + 0x800000u);
}

// Round-to-nearest-even, saturating float -> e4m3fn (NaN stays NaN). Portable bit arithmetic.
PETIT_HOST_DEVICE uint8_t petit_float_to_e4m3(float f) {
  const uint32_t bits = petit_float_bits(f);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return uint8_t(sign | 0x7f);  // NaN
  // 464 = the midpoint between 448 (largest finite) and the next e4m3 step: from there on a
  // non-saturating conversion would overflow; saturate everything >= 448's rounding range.
  if (abs_bits >= 0x43e80000u) return uint8_t(sign | 0x7e);  // >= 464 (or inf): 448
  if (abs_bits < 0x3c800000u) {  // < 2^-6: subnormal range, steps of 2^-9
    // a * 2^9 is exact; round half to even to an integer m in [0, 8] (8 = 2^-6, the
    // smallest normal, whose encoding 0x08 is exactly m).
    const float scaled = petit_bits_float(abs_bits) * 512.0f;
    uint32_t m = uint32_t(scaled);
    const float frac = scaled - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return uint8_t(sign | m);
  }
  // Normal: keep 3 mantissa bits, round half to even on the 20 dropped bits.
  const uint32_t rounded = abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u);
  const uint32_t exponent = (rounded >> 23) - 127u + 7u;  // >= 1 here
  const uint32_t code = (exponent << 3) | ((rounded >> 20) & 7u);
  return uint8_t(sign | (code > 0x7eu ? 0x7eu : code));
}

// Two floats -> two e4m3 bytes (low byte = a), with the portable conversion everywhere: it is
// bit-identical to c10's float8_e4m3fn cast (CPU test tests/test_fp8_cpu.py), which torch's
// and vLLM's quantizers use, and a few integer operations per element cost nothing in a
// copy loop bound by the peer links.
PETIT_DEVICE uint16_t petit_float2_to_e4m3x2(float a, float b) {
  return uint16_t(petit_float_to_e4m3(a)) | uint16_t(uint16_t(petit_float_to_e4m3(b)) << 8);
}

}  // namespace petit
