// The 16-lane vector of fixed_order_attention_body.h for its AVX2 build: two 8-lane halves.
// Included by fixed_order_attention.cpp inside the AVX2 namespace (under `#pragma GCC target
// ("avx2,fma")`), before the body, with SF_ATTENTION_AVX2 defined so that the body leaves out its
// own definitions of what this file defines.
//
// The other builds use a GCC vector of 16 floats. Without AVX-512 GCC keeps such a vector in
// memory and moves single lanes through the stack for every shuffle, blend or fused multiply-add
// of its halves: 32 decode tokens at context 256, one thread, ~68 us a KV head against ~6.5 with
// AVX-512. A struct of two __m256 lives in registers. Every operation here computes what the GCC
// vector's computes lane by lane (the same operations in the same order, each rounded once), and
// the shuffles move the same lanes: the same bits as the other builds (a test compares them).

struct v16 {
  __m256 h[2];  // lanes 0-7, 8-15
};

static inline v16 splat16(float x) {
  const __m256 b = _mm256_set1_ps(x);
  return v16{{b, b}};
}

#define SF_LANEWISE(OP, FN)                                    \
  static inline v16 operator OP(v16 a, v16 b) {                \
    return v16{{FN(a.h[0], b.h[0]), FN(a.h[1], b.h[1])}};      \
  }                                                            \
  static inline v16 operator OP(v16 a, float s) { return a OP splat16(s); }
SF_LANEWISE(+, _mm256_add_ps)
SF_LANEWISE(-, _mm256_sub_ps)
SF_LANEWISE(*, _mm256_mul_ps)
SF_LANEWISE(/, _mm256_div_ps)
#undef SF_LANEWISE

static inline v16 fma16(v16 a, v16 b, v16 c) {
  return v16{{_mm256_fmadd_ps(a.h[0], b.h[0], c.h[0]), _mm256_fmadd_ps(a.h[1], b.h[1], c.h[1])}};
}

static inline v16 load16(const float* p) { return v16{{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}}; }

static inline void store16(float* p, v16 v) {
  _mm256_storeu_ps(p, v.h[0]);
  _mm256_storeu_ps(p + 8, v.h[1]);
}

// a > b ? a : b per lane (MAXPS returns its second operand where either is NaN or both are 0)
static inline v16 larger16(v16 a, v16 b) {
  return v16{{_mm256_max_ps(a.h[0], b.h[0]), _mm256_max_ps(a.h[1], b.h[1])}};
}

// exp16_nonpositive of the body, half by half
static inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 below = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  const __m256 clamped = _mm256_blendv_ps(x, low, below);
  const __m256 shifted =
      _mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(12582912.0f));
  const __m256 n = _mm256_sub_ps(shifted, _mm256_set1_ps(12582912.0f));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), clamped);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 power = _mm256_castsi256_ps(bits);
  return _mm256_blendv_ps(_mm256_mul_ps(y, power), _mm256_setzero_ps(), below);
}

static inline v16 exp16_nonpositive(v16 x) {
  return v16{{exp8_nonpositive(x.h[0]), exp8_nonpositive(x.h[1])}};
}

// lane_trees16 of the body on halves: halves (lo + hi), quarters (the 128-bit lanes of two
// halves), pairs of lanes (shuffles within 128-bit lanes), then lanes, put back in order
__attribute__((always_inline)) static inline v16 lane_trees16(const v16* a) {
  __m256 x[8][2], y[4][2], z[2][2];
  for (int i = 0; i < 8; ++i) {
    x[i][0] = _mm256_add_ps(a[i].h[0], a[i].h[1]);
    x[i][1] = _mm256_add_ps(a[i + 8].h[0], a[i + 8].h[1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h)
      y[i][h] = _mm256_add_ps(_mm256_permute2f128_ps(x[i][h], x[i + 4][h], 0x20),
                              _mm256_permute2f128_ps(x[i][h], x[i + 4][h], 0x31));
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h)
      z[i][h] = _mm256_add_ps(_mm256_shuffle_ps(y[i][h], y[i + 2][h], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(y[i][h], y[i + 2][h], _MM_SHUFFLE(3, 2, 3, 2)));
  v16 result;
  for (int h = 0; h < 2; ++h) {  // lanes 0, 2, 1, 3 (and 4, 6, 5, 7), then in order
    const __m256 sums =
        _mm256_add_ps(_mm256_shuffle_ps(z[0][h], z[1][h], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(z[0][h], z[1][h], _MM_SHUFFLE(3, 1, 3, 1)));
    result.h[h] = _mm256_permute_ps(sums, _MM_SHUFFLE(3, 1, 2, 0));
  }
  return result;
}

static inline float lane_tree(v16 acc) {
  const __m256 eighths = _mm256_add_ps(acc.h[0], acc.h[1]);
  const __m128 quarters =
      _mm_add_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
  float q[4];
  _mm_storeu_ps(q, quarters);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// 32 bfloat16 values as 16 words: the even dims by a shift, the odd ones by a mask
static inline void split_pairs(const Bf16* in, v16& even, v16& odd) {
  for (int h = 0; h < 2; ++h) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + h);
    even.h[h] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    odd.h[h] = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF0000)));
  }
}

// store_pairs of the body for bfloat16: rounded to nearest even, NaN as 0x7FC0
static inline __m256i bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd_bit = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd_bit));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

static inline void store_pairs(Bf16* out, v16 even, v16 odd) {
  for (int h = 0; h < 2; ++h) {
    const __m256i words =
        _mm256_or_si256(_mm256_srli_epi32(bf16_rounded(even.h[h]), 16),
                        _mm256_and_si256(bf16_rounded(odd.h[h]), _mm256_set1_epi32(0xFFFF0000)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out) + h, words);
  }
}

// 32 float16 values as 16 words: per 8 words, the even dims' halves then the odd dims' gathered
// within each 128-bit lane (VPSHUFB: one instruction where a mask, a shift and PACKUSDW took
// three), the 64-bit quarters put in order, and widened to float32 (VCVTPH2PS: exact,
// subnormals included). 32 decode tokens at context 256 from the L3 cache: ~310 -> ~290 us a
// call at best.
static inline void split_pairs(const Fp16* in, v16& even, v16& odd) {
  const __m256i gather = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int h = 0; h < 2; ++h) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + h);
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, gather),
                                                    _MM_SHUFFLE(3, 1, 2, 0));
    even.h[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    odd.h[h] = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
  }
}

// 32 float8 e4m3fn values / 256, exact, 16 at a time as 8 words: each byte moved to the top of
// a word (the even ones by a shift), shifted down one place with its sign and masked to sign,
// exponent and mantissa: float16 bits (float8_e4m3fn_to_half_256th), widened by VCVTPH2PS
static inline void split_pairs_256th(const Fp8* in, v16& even, v16& odd) {
  const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xBF80));
  for (int h = 0; h < 2; ++h) {
    const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in) + h);
    even.h[h] = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(words, 8), 1), keep));
    odd.h[h] = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(words, 1), keep));
  }
}
// the values themselves: times 256, exact
static inline void split_pairs(const Fp8* in, v16& even, v16& odd) {
  split_pairs_256th(in, even, odd);
  const __m256 scale = _mm256_set1_ps(256.0f);
  for (int h = 0; h < 2; ++h) {
    even.h[h] = _mm256_mul_ps(even.h[h], scale);
    odd.h[h] = _mm256_mul_ps(odd.h[h], scale);
  }
}

// 32 floats: the even dims into even, the odd ones into odd ([0 2 8 10 | 4 6 12 14] of 16
// values, then its 64-bit pairs in order)
static inline void split_pairs(const float* in, v16& even, v16& odd) {
  for (int h = 0; h < 2; ++h) {
    const __m256 a = _mm256_loadu_ps(in + 16 * h), b = _mm256_loadu_ps(in + 16 * h + 8);
    even.h[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
        _MM_SHUFFLE(3, 1, 2, 0)));
    odd.h[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
        _MM_SHUFFLE(3, 1, 2, 0)));
  }
}

// split_pairs' inverse for float32 ([e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7],
// then their 128-bit lanes in order)
static inline void store_pairs(float* out, v16 even, v16 odd) {
  for (int h = 0; h < 2; ++h) {
    const __m256 first = _mm256_unpacklo_ps(even.h[h], odd.h[h]);
    const __m256 second = _mm256_unpackhi_ps(even.h[h], odd.h[h]);
    _mm256_storeu_ps(out + 16 * h, _mm256_permute2f128_ps(first, second, 0x20));
    _mm256_storeu_ps(out + 16 * h + 8, _mm256_permute2f128_ps(first, second, 0x31));
  }
}
