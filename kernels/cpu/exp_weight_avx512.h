// exp_weight: exp(x) per lane for the online softmax of the prompt attention kernels
// (prompt_attention_amx.cpp, prompt_attention_avx512.cpp). Include it where AVX-512F is the
// target (a #pragma GCC target region).
#pragma once

#include <immintrin.h>

namespace splitfuse_exp {

// exp(x) per lane for finite x <= 0 (and a little above), within ~3e-6 relative: enough for
// weights rounded to bfloat16 and their float32 sums. 2^(x log2 e) from its fraction's Taylor
// polynomial of degree 5 and VSCALEFPS (0 far below), ~9 instructions where a full-precision
// exp takes ~16: the weights' exp was the largest part of the kernels' vector work. exp(0) is
// exactly 1.
inline __m512 exp_weight(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace splitfuse_exp
