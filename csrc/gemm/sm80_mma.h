// mma.sync m16n8k16 (bf16 -> fp32) on operands loaded straight from global memory into
// registers, for the weight-streaming GEMMs of the fused layer (experts/megamoe.cu).
//
// Why no shared memory: in decode a tile's weights are read once, so staging them through
// shared memory only adds latency. Each lane loads 16 contiguous bytes (8 bf16 along k) of a
// weight row, and the k order inside one 32-element span is permuted identically for A and B,
// which leaves every dot product unchanged (a sum over k does not depend on its order):
//
//   lane (g = lane / 4, q = lane % 4) loads A rows g and g + 8 and the B column (token) g, each
//   at k = 8q .. 8q + 7 of the span, as uint4 {k0k1, k2k3, k4k5, k6k7}. Two mma.sync cover the
//   span: the first takes the .x/.y words, the second the .z/.w words. PTX's fragment slots
//   (a = {A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]}, b = {B[2q..][g],
//   B[2q+8..][g]}) then hold the same memory k for A and for B in every slot.
//
// CUDA sm_80+ (and the CPU emulation of tests/emu); include only where PETIT_SM80_PATH is set.
#pragma once

#include "common/platform.h"

namespace petit {
namespace gemm {

// D += A * B, A 16x16 (row), B 16x8 (col), fp32 accumulators d[4] =
// {D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]}.
PETIT_DEVICE void mma_16816_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                 uint32_t a3, uint32_t b0, uint32_t b1) {
#if PETIT_SM80_DEVICE
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif PETIT_EMU_PTX
  const uint32_t a[4] = {a0, a1, a2, a3};
  emu_ptx::mma_bf16_16816(d[0], d[1], d[2], d[3], a, b0, b1);
#else
  (void)d, (void)a0, (void)a1, (void)a2, (void)a3, (void)b0, (void)b1;
#endif
}

// One 32-element k span: rows (g, g + 8) of A as lo / hi, the B column as b (layout above).
PETIT_DEVICE void mma_span32(float (&d)[4], const uint4& lo, const uint4& hi, const uint4& b) {
  mma_16816_bf16(d, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  mma_16816_bf16(d, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// e4m3 weights widened to bf16 for the same mma.sync. Bytes 1 and 3 of `t` (two e4m3fn values)
// -> bf16x2 (low half from byte 1): sign, then the 4 exponent and 3 mantissa bits placed under
// bf16's exponent bias, which reads as the e4m3 value times 2^-120 (a bf16 subnormal where the
// e4m3 value is one); times 2^120 (exact: at most 4 significant bits, in range) gives it
// exactly. Bytes 0 and 2 are those of `t << 8`: a word's k order becomes (0, 2), (1, 3), which
// bf16_pairs_even_odd applies to the B operand alike. e4m3fn's NaN (0x7F) is not produced by
// the checkpoints' quantizers and is not handled.
PETIT_DEVICE uint32_t e4m3_x4_to_bf16(uint32_t t) {
  const uint32_t scaled = (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);
#if PETIT_SM80_DEVICE
  uint32_t out;
  // bf16x2 * 2^120 (0x7B80 each), round-to-nearest: exact here, subnormal inputs included
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(scaled), "r"(0x7B807B80u), "r"(0x80008000u));
  return out;
#else
  uint32_t out = 0;
  for (int half = 0; half < 2; ++half) {
    const uint32_t bits = ((scaled >> (16 * half)) & 0xFFFFu) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    f *= 0x1p120f;
    uint32_t widened;
    __builtin_memcpy(&widened, &f, 4);
    out |= (widened >> 16) << (16 * half);
  }
  return out;
#endif
}

// Eight bf16 along k as uint4 {k0k1, k2k3, k4k5, k6k7} -> {k0k2, k1k3, k4k6, k5k7}: the k order
// of e4m3_x4_to_bf16's words (low half first).
PETIT_DEVICE uint4 bf16_pairs_even_odd(const uint4& v) {
  return make_uint4((v.x & 0xFFFFu) | (v.y << 16), (v.x >> 16) | (v.y & 0xFFFF0000u),
                    (v.z & 0xFFFFu) | (v.w << 16), (v.z >> 16) | (v.w & 0xFFFF0000u));
}

// 16-byte load of streamed weights: read once per call, so kept out of L1.
PETIT_DEVICE uint4 load_stream(const void* ptr) {
#if PETIT_SM80_DEVICE
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
#else
  return *reinterpret_cast<const uint4*>(ptr);
#endif
}

}  // namespace gemm
}  // namespace petit
