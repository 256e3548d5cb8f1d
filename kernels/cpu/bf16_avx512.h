// bfloat16 in AVX-512 registers, for the operators of kernels/cpu/ (decode_stack.cpp's row
// operators, int4_amx.cpp's results rounded to x's dtype). Include it where AVX-512F/BW/VL are
// the target (a #pragma GCC target region).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace splitfuse_bf16 {

// Each lane rounded to bfloat16 (to nearest even, as torch rounds a float) and widened back, in
// integer operations (VCVTNEPS2BF16 would flush subnormals); a NaN stays NaN, made quiet so
// that its high half is one too. The NaN lanes come from one unordered compare and take the
// quiet bit by one masked OR (7 vector instructions in all where an integer test of the bits
// took 9, the same bits for every input: rms_norm_rows of 512 x 576 bfloat16 rows with a
// residual, 2 cores of an Intel Xeon with AMX, 75.6-77.0 -> 70.2-71.9 us in alternating runs).
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb),
                       _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(
      _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000)));
}

// The lanes of `mask` from bfloat16 bits at p, widened (the others zero).
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The lanes of `mask` of v, already rounded (round_bf16), as bfloat16 bits at p.
inline void store_bf16(uint16_t* p, __m512 v, __mmask16 mask) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_mask_storeu_epi16(p, mask, half);
}

}  // namespace splitfuse_bf16
