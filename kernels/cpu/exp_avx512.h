// exp on AVX-512 for the elementwise loops of kernels/cpu/ that need it (decode_stack.cpp's
// SiLU, prompt_attention_amx.cpp's softmax), compiled for AVX-512F: call it from code compiled
// for AVX-512F (and more), on CPUs that have it.
#pragma once

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace splitfuse_exp {

// exp(t) per lane for -87 <= t <= 0 (the caller clamps), within ~2 ulp: Cephes' polynomial on
// t - n ln 2 (ln 2 in two parts, n = t / ln 2 rounded to nearest), then 2^n from the exponent
// bits; fused multiply-adds throughout, so every caller gets the same bits.
inline __m512 exp_clamped(__m512 t) {
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(t, _mm512_set1_ps(1.44269504088896341f), big), big);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(exponent));
}

}  // namespace splitfuse_exp

#pragma GCC pop_options
