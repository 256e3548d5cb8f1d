// The AVX-512 parameters and helpers of int4_linear_body.h, included inside a namespace under
// `#pragma GCC target`; SF_VNNI (1 or 0) picks how bytes multiply: VPDPBUSD, or without VNNI
// pairs of byte products in int16 (at most 2 * 15 * 127: no saturation), summed over a run and
// then widened in pairs to int32.

#define SF_LANES 16
// Tiles of 6 rows and 2 column blocks (12 float and 12 int32 accumulators, 4 vectors of
// nibbles): a step's unpacking serves 6 rows instead of 4. Each run of 32 then costs ~96
// VPDPBUSD, 24 unpacking and 48 scaling instructions on the two vector ports.
#define SF_ROW_TILE 6
#define SF_COL_BLOCKS 2
#define SF_ONE_ROW_BLOCKS 1
#define SF_BYTE_DOT SF_VNNI
typedef int32_t vint __attribute__((vector_size(64)));
typedef float vfloat __attribute__((vector_size(64)));
typedef uint8_t vbyte __attribute__((vector_size(64)));
#if SF_VNNI
static inline vint dot4(vint acc, vbyte w, int32_t x) {
  return (vint)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x));
}
#else
typedef int16_t vpair __attribute__((vector_size(64)));
static inline vpair byte_pairs(vbyte w, int32_t x) {
  return (vpair)_mm512_maddubs_epi16((__m512i)w, _mm512_set1_epi32(x));
}
static inline vint pair_sums(vpair p) {
  return (vint)_mm512_madd_epi16((__m512i)p, _mm512_set1_epi16(1));
}
#endif
static inline vfloat load_halves(const uint16_t* p) {
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline vint round_even(vfloat v) { return (vint)_mm512_cvtps_epi32((__m512)v); }
#include "int4_linear_body.h"
