// splitfuse_cpu.DecodeStack: a decode step of a Llama stack on a CPU, every layer in one
// parallel region of the CPU's threads. Its products are 4-bit (int4_linear.cpp's kernel) or
// bfloat16 in oneDNN's blocked layout (blocked_linear.cpp's), every product of a stack alike.
//
// A decode step of one or a few tokens reads ~66 MB of 4-bit weights (~200 MB in bfloat16), but
// as a graph of operators it ran ~10 of them a layer: each a dispatcher call, a tensor or two
// allocated, a fork and a join of the threads, and between them the first thread's serial
// work, which the weights' stream keeps pushing out of the caches; the second thread waited for
// work ~45% of a 4-bit step. Here the threads run the whole stack together and meet at 5
// barriers a layer, each computing its share of every product's column blocks and of
// attention's items, and then what is left of the others' (Claims); what is small
// and serial (the norms, a product's input rows rounded to int8) each thread computes whole for
// itself rather than waiting for one to do it. From kShareRows tokens (up to 32 a step, where
// the stack still beats the graphs) a product's input rows are rounded once, each thread a
// share of them, at one more barrier a product.
//
// Per layer, with the model's roundings (engine/models/llama.py; activations float32 or
// bfloat16, every product's output rounded to the activations' dtype):
//
//   summed = x + residual; residual = summed         (x alone in the first layer)
//   normed = round(round(rms_norm(summed)) * w_in)
//   qkv    = round(product(normed))                     -> rotary on q and k (float32, rounded)
//   K/V stored into slots[t] of the layer's cache (float32, bfloat16 or float16, whatever
//          the activations' dtype: rounded to nearest even where it is narrower, as the
//          model's store rounds); attention of each token over its context
//          (the fixed-order kernel of fixed_order_attention.cpp: the same bits as the
//          operator store_and_attend_step gives a decode token)
//   x      = round(product(attention))
//   summed = x + residual; residual = summed; normed = round(round(rms_norm(summed)) * w_post)
//   act    = round(round(silu(gate)) * up), gate and up = round(product(normed)) halves
//   x      = round(product(act))
//
// and the final norm after the last layer. Where the stack holds the 8-bit embedding and LM head
// (`logits`; packed as int8_linear reads them), it starts from the token ids (the embedding's rows
// dequantized and rounded as the model does) and ends with the LM head: every thread the final norm
// and its rounding to int8, then its share of the vocabulary's column blocks through int8_linear's
// kernel (int4_linear.h), the logits its float32 sums as the model's quantized head returns them
// (ParallelLMHead.float32_result). The products and attention are the operators' own kernels on
// the same inputs, so they give the same bits as the operators; the norms, rotary and SiLU are
// written here, in float32 as the model computes them, and are the operators rms_norm_rows,
// rotary_rows and silu_mul_rows too (at the end of this file), which a 4-bit model's forward
// runs on CPUs: a decode token gets the same bits from the stack and from the graphs.
//
// Every input is checked before the cache is written; a bad one raises and changes nothing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include "blocked_linear.h"
#include "fixed_order_attention.h"
#include "float16_bits.h"
#include "greedy_argmax.h"
#include "int4_amx.h"
#include "int4_linear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr const char* kName = "DecodeStack";
constexpr int64_t kCols = 16;  // output columns per packed 4-bit block
// Steps of at least this many tokens prepare a product's input rows once, the threads sharing
// them, rather than in every thread: one more barrier a product, and less arithmetic each. One
// engine's steps alternating between the two (int4, 2 threads, context 256): 32 tokens 30.09 ->
// 29.78 and 30.58 -> 29.99 ms, 24 tokens 23.90 -> 23.77, 12 tokens even, 8 tokens 13.01 -> 13.46.
constexpr int64_t kShareRows = 16;
// Steps of more than kTouchTokens tokens split a layer's first product into this many runs of
// column blocks, between which each thread asks for its first attention item's context. One
// int4 engine's steps alternating with and without (context 256, 2 threads): 32 tokens 31.18 ->
// 30.84 and 35.82 -> 35.32 ms, 24 tokens 28.28 -> 27.76, 16 tokens 20.55 -> 20.11.
constexpr int64_t kEarlyParts = 8;
// A product's column blocks are shared out (Claims) in units of kUnitBlocks blocks (the 4-bit
// kernel's tiles of several rows span 2 blocks), each thread taking its own share in about
// kChunks chunks; the LM head's in units of kHeadUnitBlocks blocks, one at a time (each unit's
// argmax is kept apart, and joined in column order).
constexpr int64_t kUnitBlocks = 2;
constexpr int64_t kChunks = 4;
constexpr int64_t kHeadUnitBlocks = 32;
using splitfuse_fixed_order::kTouchTokens;
using splitfuse_fixed_order::kWholeTokenItems;

// float -> bfloat16 -> float, to nearest even (as torch's conversion; NaN stays NaN); no
// branch, so that loops of it vectorize
inline float round_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  bits = (bits & 0x7fffffffu) > 0x7f800000u ? bits : rounded;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline uint16_t bf16_bits(float rounded) {
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 (Cephes' polynomial on x - n ln 2, then 2^n from the exponent bits):
// within 2 ulp of expf; written so that a loop of it vectorizes.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// x / (1 + exp(-x)), as sigmoid through exp(-|x|): 1 / (1 + e) or e / (1 + e), the numerator
// picked before the one division (a vector of them divides once, not twice)
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float sigmoid = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
  return x * sigmoid;
}

// The elementwise loops, compiled for AVX-512, AVX2 and the baseline (picked at load).
#define SF_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
// The loops of float arithmetic (norms, SiLU, rotary) run only where the AVX-512 rows do not:
// on CPUs without AVX-512, or held below it by SPLITFUSE_CPU_ISA. They are compiled for AVX2
// and the baseline alone, neither of which fuses a multiply and an add (-ffp-contract=fast
// fuses them only for a target with FMA), so that a CPU held to AVX2 computes them as an
// AVX2-only CPU does. An AVX-512 clone fused them: held to AVX2, an Intel Xeon's SiLU then gave
// other bits than an AVX2-only AMD EPYC's (272 values of 37 x 1541; the test of
// rows_avx2::silu_mul against the loop found it).
#define SF_FLOAT_CLONES __attribute__((target_clones("avx2", "default")))

// out[i] = in[i] rounded to the activations' dtype (integer operations: every clone's bits)
SF_CLONES void round_into(const float* in, float* out, int64_t n, bool bf16) {
  if (bf16)
    for (int64_t i = 0; i < n; ++i) out[i] = round_bf16(in[i]);
  else if (in != out)
    std::memcpy(out, in, sizeof(float) * n);
}

// 1 / sqrt(mean(r^2) + eps) of a row (inlined into each caller, which all compile it alike)
inline float inverse_rms(const float* r, int64_t n, float eps) {
  float lanes[16] = {};  // 16 partial sums, so that the loop vectorizes
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += r[i + j] * r[i + j];
  for (; i < n; ++i) lanes[0] += r[i] * r[i];
  float squares = 0.0f;
  for (int j = 0; j < 16; ++j) squares += lanes[j];
  return 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
}

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// norm_row (below) written for the compiler to vectorize (CPUs without AVX-512)
SF_FLOAT_CLONES void norm_row_loop(const float* in, float* residual, const float* w,
                                   float* out, int64_t n, float eps, bool first, bool bf16) {
  for (int64_t i = 0; i < n; ++i) {
    const float sum = first ? in[i] : in[i] + residual[i];
    residual[i] = bf16 && !first ? round_bf16(sum) : sum;
  }
  const float inverse = inverse_rms(residual, n, eps);
  if (bf16)
    for (int64_t i = 0; i < n; ++i) out[i] = round_bf16(round_bf16(residual[i] * inverse) * w[i]);
  else
    for (int64_t i = 0; i < n; ++i) out[i] = residual[i] * inverse * w[i];
}

// norm_row_loop's bfloat16 case on bfloat16 rows: the sum into `sum` (n floats) and, without
// `first`, as bfloat16 into summed; the same arithmetic, the same bits
SF_FLOAT_CLONES void norm_row_bf16_loop(const uint16_t* in, const uint16_t* residual,
                                        const float* w, uint16_t* out, uint16_t* summed,
                                        float* sum, int64_t n, float eps, bool first) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) sum[i] = bf16_value(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = round_bf16(bf16_value(in[i]) + bf16_value(residual[i]));
      summed[i] = bf16_bits(sum[i]);
    }
  }
  const float inverse = inverse_rms(sum, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(round_bf16(round_bf16(sum[i] * inverse) * w[i]));
}

// act[i] = round(round(silu(gate[i])) * up[i]), written for the compiler to vectorize (CPUs
// without AVX-512; silu_mul below picks)
SF_FLOAT_CLONES void silu_mul_loop(const float* gate, const float* up, float* act, int64_t n,
                                   bool bf16) {
  if (bf16)
    for (int64_t i = 0; i < n; ++i) act[i] = round_bf16(round_bf16(silu(gate[i])) * up[i]);
  else
    for (int64_t i = 0; i < n; ++i) act[i] = silu(gate[i]) * up[i];
}

}  // namespace

// SiLU on AVX-512, 16 values a vector: the compiler left silu_mul_loop's bfloat16 case partly
// scalar (a prompt chunk's 512 x 1536 values took ~0.5 ms, ~2.4 ms from bfloat16 rows). The same
// steps as silu() and exp_nonpositive() (their multiply-adds fused; the polynomial is the one
// fixed_order_attention_body.h's exp16_nonpositive spells in vector extensions, whose clamp and
// bits for attention's weights differ), 1 / (1 + e) by a reciprocal and a Newton step, and
// round_bf16 in integer operations (bf16_avx512.h).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
#include "bf16_avx512.h"

namespace rows_avx512 {

using splitfuse_bf16::load_bf16;
using splitfuse_bf16::round_bf16;
using splitfuse_bf16::store_bf16;

inline __m512 silu(__m512 x) {
  __m512 t = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)),
                           _mm512_set1_ps(-87.0f));  // -|x|, clamped
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
  const __m512 e0 = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(e0, _mm512_castsi512_ps(exponent));
  const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 numerator = _mm512_mask_mov_ps(e, positive, _mm512_set1_ps(1.0f));
  // 1 / (1 + e) from VRCP14PS and a Newton step (2^-14 -> within 2^-23 or so), not a division
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
  const __m512 y0 = _mm512_rcp14_ps(d);
  const __m512 y1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y0, _mm512_set1_ps(1.0f)), y0, y0);
  return _mm512_mul_ps(x, _mm512_mul_ps(numerator, y1));
}

inline __m512 act(__m512 gate, __m512 up, bool bf16) {
  return bf16 ? round_bf16(_mm512_mul_ps(round_bf16(silu(gate)), up))
              : _mm512_mul_ps(silu(gate), up);
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, bool bf16) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i), u = _mm512_maskz_loadu_ps(mask, up + i);
    _mm512_mask_storeu_ps(out + i, mask, act(g, u, bf16));
  }
}

void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    store_bf16(out + i, act(load_bf16(gate + i, mask), load_bf16(up + i, mask), true), mask);
  }
}

// silu_mul_bf16 on float32 products not yet rounded: each rounded to bfloat16 first, as
// round_into rounds them (int4_silu_mul's rows, in one pass)
void silu_mul_products(const float* gate, const float* up, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = round_bf16(_mm512_maskz_loadu_ps(mask, gate + i));
    const __m512 u = round_bf16(_mm512_maskz_loadu_ps(mask, up + i));
    store_bf16(out + i, act(g, u, true), mask);
  }
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// 1 / sqrt(mean(squares' lanes summed) + eps), the lanes summed in _mm512_reduce_add_ps's order
inline float inverse_rms(__m512 squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
}

// norm_row_loop's arithmetic, 16 values a vector: the sum of squares in 16 lanes of fused
// multiply-adds (norm_row_bf16 below does the same, so that the stack and the operator agree)
void norm_row(const float* in, float* residual, const float* w, float* out, int64_t n, float eps,
              bool first, bool bf16) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    __m512 sum = _mm512_maskz_loadu_ps(mask, in + i);
    if (!first) {
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, residual + i));
      if (bf16) sum = round_bf16(sum);
    }
    _mm512_mask_storeu_ps(residual + i, mask, sum);
    squares = _mm512_fmadd_ps(sum, sum, squares);
  }
  const __m512 inverse = _mm512_set1_ps(inverse_rms(squares, n, eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, residual + i), inverse);
    const __m512 weight = _mm512_maskz_loadu_ps(mask, w + i);
    _mm512_mask_storeu_ps(out + i, mask,
                          bf16 ? round_bf16(_mm512_mul_ps(round_bf16(scaled), weight))
                               : _mm512_mul_ps(scaled, weight));
  }
}

// norm_row's bfloat16 case on bfloat16 rows (the sum, without `first`, into summed as
// bfloat16): the same arithmetic, the same bits
void norm_row_bf16(const uint16_t* in, const uint16_t* residual, const float* w, uint16_t* out,
                   uint16_t* summed, int64_t n, float eps, bool first) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    __m512 sum = load_bf16(in + i, mask);
    if (!first) {
      sum = round_bf16(_mm512_add_ps(sum, load_bf16(residual + i, mask)));
      store_bf16(summed + i, sum, mask);
    }
    squares = _mm512_fmadd_ps(sum, sum, squares);
  }
  const __m512 inverse = _mm512_set1_ps(inverse_rms(squares, n, eps));
  const uint16_t* sums = first ? in : summed;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 scaled = round_bf16(_mm512_mul_ps(load_bf16(sums + i, mask), inverse));
    store_bf16(out + i, round_bf16(_mm512_mul_ps(scaled, _mm512_maskz_loadu_ps(mask, w + i))),
               mask);
  }
}

// rotate_head_loop's arithmetic, 16 values a vector: each product and the sum rounded on their
// own (fp-contract off: no fused multiply-add)
__attribute__((optimize("fp-contract=off"))) inline void rotate(__m512 a, __m512 b, __m512 c,
                                                                __m512 s, __m512* low,
                                                                __m512* high) {
  *low = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s));
  *high = _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s));
}

__attribute__((optimize("fp-contract=off"))) void rotate_head(const float* in, const float* cos,
                                                             const float* sin, float* out,
                                                             int64_t half, bool bf16) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 mask = tail_mask(half - i);
    __m512 low, high;
    rotate(_mm512_maskz_loadu_ps(mask, in + i), _mm512_maskz_loadu_ps(mask, in + half + i),
           _mm512_maskz_loadu_ps(mask, cos + i), _mm512_maskz_loadu_ps(mask, sin + i), &low,
           &high);
    _mm512_mask_storeu_ps(out + i, mask, bf16 ? round_bf16(low) : low);
    _mm512_mask_storeu_ps(out + half + i, mask, bf16 ? round_bf16(high) : high);
  }
}

// rotate_head's bfloat16 case on a bfloat16 head
__attribute__((optimize("fp-contract=off"))) void rotate_head_bf16(const uint16_t* in,
                                                                  const float* cos,
                                                                  const float* sin,
                                                                  uint16_t* out, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 mask = tail_mask(half - i);
    __m512 low, high;
    rotate(load_bf16(in + i, mask), load_bf16(in + half + i, mask),
           _mm512_maskz_loadu_ps(mask, cos + i), _mm512_maskz_loadu_ps(mask, sin + i), &low,
           &high);
    store_bf16(out + i, round_bf16(low), mask);
    store_bf16(out + half + i, round_bf16(high), mask);
  }
}

}  // namespace rows_avx512
#pragma GCC pop_options

// SiLU on AVX2, 8 values a vector, for CPUs without AVX-512 (the compiler left silu_mul_loop
// scalar there, its branches kept: ~10% of a 32-token int4 decode step on an AVX2-only AMD
// EPYC). The same operations as silu(), exp_nonpositive() and round_bf16() in the same order,
// none fused (the avx2 target has no FMA, nor had silu_mul_loop's clone) and the one division
// kept, so it gives silu_mul_loop's bits: NaN and the clamp at -87 included.
#pragma GCC push_options
#pragma GCC target("avx2")

namespace rows_avx2 {

inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd),
      _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  // NaN (|bits| > inf as integers) keeps its bits
  const __m256i nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, bits, nan));
}

inline __m256 silu(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 t = _mm256_or_ps(x, sign);  // -|x|
  const __m256 low = _mm256_set1_ps(-87.0f);
  t = _mm256_blendv_ps(t, low, _mm256_cmp_ps(t, low, _CMP_LT_OQ));  // NaN stays NaN
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256 n =
      _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)), big), big);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(t, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e0 = _mm256_add_ps(
      _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(e0, _mm256_castsi256_ps(exponent));
  const __m256 numerator =
      _mm256_blendv_ps(e, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(x, _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

inline __m256 act(__m256 gate, __m256 up, bool bf16) {
  return bf16 ? round_bf16(_mm256_mul_ps(round_bf16(silu(gate)), up))
              : _mm256_mul_ps(silu(gate), up);
}

// act over whole vectors; returns how many values it wrote (n rounded down to 8)
int64_t silu_mul(const float* gate, const float* up, float* out, int64_t n, bool bf16) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, act(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), bf16));
  return i;
}

}  // namespace rows_avx2
#pragma GCC pop_options

namespace {

// The row operators' widest body: AVX-512, AVX2 (SiLU only) or the loops; SPLITFUSE_CPU_ISA=avx2
// or sse2 asks for a narrower one, as for the quantized product
const std::string kRowsLimit = std::getenv("SPLITFUSE_CPU_ISA") ? std::getenv("SPLITFUSE_CPU_ISA") : "";
const bool kRowsAvx2 = kRowsLimit != "sse2" && __builtin_cpu_supports("avx2");
const bool kRowsAvx512 = kRowsAvx2 && kRowsLimit != "avx2" && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vl");

// act[i] = round(round(silu(gate[i])) * up[i]) (bf16: rounded to bfloat16 as shown; else
// silu(gate[i]) * up[i]), on AVX-512 or AVX2 where the CPU has it (AVX2: silu_mul_loop's bits)
void silu_mul(const float* gate, const float* up, float* act, int64_t n, bool bf16) {
  if (kRowsAvx512) {
    rows_avx512::silu_mul(gate, up, act, n, bf16);
    return;
  }
  const int64_t done = kRowsAvx2 ? rows_avx2::silu_mul(gate, up, act, n, bf16) : 0;
  if (done < n) silu_mul_loop(gate + done, up + done, act + done, n - done, bf16);
}

// silu_mul's bfloat16 case on bfloat16 rows: widened a chunk at a time into floats for
// silu_mul_loop (written per value, the compiler left the loop scalar: ~6x the time)
void silu_mul_bf16_loop(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
  constexpr int64_t kChunk = 256;
  alignas(64) float g[kChunk], u[kChunk], a[kChunk];
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t count = std::min(kChunk, n - begin);
    for (int64_t i = 0; i < count; ++i) {
      g[i] = bf16_value(gate[begin + i]);
      u[i] = bf16_value(up[begin + i]);
    }
    silu_mul(g, u, a, count, true);
    for (int64_t i = 0; i < count; ++i) act[begin + i] = bf16_bits(a[i]);
  }
}

void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
  if (kRowsAvx512)
    rows_avx512::silu_mul_bf16(gate, up, act, n);
  else
    silu_mul_bf16_loop(gate, up, act, n);
}

// One row: residual = in (+ residual, rounded); out = round(round(residual * inverse rms) * w)
// (norm_row_loop), on AVX-512 where the CPU has it
void norm_row(const float* in, float* residual, const float* w, float* out, int64_t n, float eps,
              bool first, bool bf16) {
  if (kRowsAvx512)
    rows_avx512::norm_row(in, residual, w, out, n, eps, first, bf16);
  else
    norm_row_loop(in, residual, w, out, n, eps, first, bf16);
}

// norm_row's bfloat16 case on bfloat16 rows (norm_row_bf16_loop; `sum`: n floats of scratch)
void norm_row_bf16(const uint16_t* in, const uint16_t* residual, const float* w, uint16_t* out,
                   uint16_t* summed, float* sum, int64_t n, float eps, bool first) {
  if (kRowsAvx512)
    rows_avx512::norm_row_bf16(in, residual, w, out, summed, n, eps, first);
  else
    norm_row_bf16_loop(in, residual, w, out, summed, sum, n, eps, first);
}

// Rotary on one head of 2 * half values: out[i] = in[i] * cos[i] - in[i + half] * sin[i] and
// out[i + half] = in[i + half] * cos[i] + in[i] * sin[i], each product and the sum rounded on
// their own as the model computes them (no fused multiply-add: fp-contract off, in every
// clone), then to the activations' dtype. (Written inline in the step, the loop ran as the
// baseline's SSE2 code: 32 decode tokens, 2 threads, steps alternating 30.66 -> 29.78 ms.)
__attribute__((optimize("fp-contract=off"))) SF_FLOAT_CLONES void rotate_head_loop(
    const float* in, const float* cos, const float* sin, float* out, int64_t half, bool bf16) {
  if (bf16) {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = round_bf16(in[i] * cos[i] - in[i + half] * sin[i]);
      out[i + half] = round_bf16(in[i + half] * cos[i] + in[i] * sin[i]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = in[i] * cos[i] - in[i + half] * sin[i];
      out[i + half] = in[i + half] * cos[i] + in[i] * sin[i];
    }
  }
}

// rotate_head_loop's bfloat16 case on a bfloat16 head: the same arithmetic, the same bits
__attribute__((optimize("fp-contract=off"))) SF_FLOAT_CLONES void rotate_head_bf16_loop(
    const uint16_t* in, const float* cos, const float* sin, uint16_t* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16_value(in[i]), b = bf16_value(in[i + half]);
    out[i] = bf16_bits(round_bf16(a * cos[i] - b * sin[i]));
    out[i + half] = bf16_bits(round_bf16(b * cos[i] + a * sin[i]));
  }
}

// rotate_head_loop and rotate_head_bf16_loop, on AVX-512 where the CPU has it
void rotate_head(const float* in, const float* cos, const float* sin, float* out, int64_t half,
                 bool bf16) {
  if (kRowsAvx512)
    rows_avx512::rotate_head(in, cos, sin, out, half, bf16);
  else
    rotate_head_loop(in, cos, sin, out, half, bf16);
}

void rotate_head_bf16(const uint16_t* in, const float* cos, const float* sin, uint16_t* out,
                      int64_t half) {
  if (kRowsAvx512)
    rows_avx512::rotate_head_bf16(in, cos, sin, out, half);
  else
    rotate_head_bf16_loop(in, cos, sin, out, half);
}


// The threads of a parallel region meeting: each arrival counts; the last one resets the count
// and moves the generation on, which the others wait for spinning (then yielding the CPU, where
// a thread may have lost it). The count's acquire-release and the generation's release/acquire
// order every thread's writes before the meeting before every read after it.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  void wait() {
    wait([] { return false; });
  }

  // wait(), calling meanwhile() (a short piece of work; false once none is left) while the
  // others have not all arrived
  template <typename Work>
  void wait(const Work& meanwhile) {
    const int64_t generation = generation_.load(std::memory_order_relaxed);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation && meanwhile()) {
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins)
        __builtin_ia32_pause();
      else
        sched_yield();
    }
  }

 private:
  static constexpr int64_t kSpins = 1 << 16;
  const int threads_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
};

using splitfuse_int4::Claims;
using splitfuse_int4::share;

// How a stack's products hold their weights (every product of a stack alike)
enum class Kind : int64_t {
  kInt4 = 4,      // 4 bits, PackedInt4 (engine/quantization.py): int4_linear's kernel
  kBlocked = 16,  // bfloat16 in oneDNN's blocked layout (engine/packed_linear.py): blocked_linear's
};

// Byte ranges asked for into the L2 cache a piece at a time (software prefetches, which never
// fault and change no result)
class Fetches {
 public:
  void add(const void* begin, int64_t bytes) {
    if (bytes <= 0 || count_ == kRanges) return;
    const char* p = static_cast<const char*>(begin);
    ranges_[count_++] = {p, p + bytes};
  }

  // the next kPiece bytes' lines asked for; false once every range is
  bool next() {
    for (; at_ < count_; ++at_) {
      auto& [p, end] = ranges_[at_];
      if (p >= end) continue;
      const char* stop = std::min(end, p + kPiece);
      for (; p < stop; p += 64) __builtin_prefetch(p, 0, 2);
      return true;
    }
    return false;
  }

 private:
  static constexpr int kRanges = 9;
  static constexpr int64_t kPiece = 4096;
  std::pair<const char*, const char*> ranges_[kRanges];
  int count_ = 0, at_ = 0;
};

struct Product {  // a weight [out_features, in_features]
  std::vector<at::Tensor> tensors;  // held: int4 packed, scales, mins; blocked the weight
  int64_t out_features = 0, in_features = 0;
  int64_t block_cols = 0;  // output columns per block of the layout: 16 (int4) or 64
  const uint8_t* packed_ptr = nullptr;  // int4: the tensors' data, read once
  const uint16_t* scales_ptr = nullptr;
  const uint16_t* mins_ptr = nullptr;
  const uint16_t* blocked_ptr = nullptr;  // blocked: [N / 64, K / 2, 64, 2] bfloat16

  int64_t blocks() const { return (out_features + block_cols - 1) / block_cols; }
};

struct Layer {
  std::vector<float> input_norm, post_norm;  // the norms' weights as floats
  Product qkv, o, gate_up, down;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;
  std::vector<float> final_norm;
  at::Tensor cos_sin;  // [max_position, head_dim] float32: cos half, sin half
  at::ScalarType dtype;  // the activations' (and the cache's): float32 or bfloat16
  Kind kind;
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, group_size;
  int64_t max_tokens;
  float eps;
  // the embedding and the LM head, 8 bits packed as int8_linear reads them, where the stack
  // holds them (head_group > 0: `logits` runs a step from token ids to logits)
  int64_t head_group = 0, vocab_size = 0;
  at::Tensor embed_packed, embed_scales, head_packed, head_scales;

  // weights: per layer input_norm, post_norm, then qkv, o, gate_up and down, each as its kind
  // holds it (int4: packed, scales, mins; blocked: the blocked weight); then the final norm; then,
  // with head_group > 0, the embedding's and the LM head's packed values [ceil(vocab_size / 16),
  // hidden * 16] uint8 and float16 scales [ceil(vocab_size / 16), hidden / head_group, 16]
  // (PackedInt8; the same tensors where they are tied).
  // sizes: num_heads, num_kv_heads, head_dim, intermediate_size, group_size (int4's), max_tokens,
  // kind (4: int4, 16: blocked bfloat16), head_group (0: no embedding and LM head), vocab_size.
  DecodeStack(std::vector<at::Tensor> weights, at::Tensor cos_sin_, std::vector<int64_t> sizes,
              double eps_)
      : cos_sin(std::move(cos_sin_)), eps(static_cast<float>(eps_)) {
    TORCH_CHECK(sizes.size() == 9, kName, ": sizes must be [num_heads, num_kv_heads, head_dim, "
                "intermediate_size, group_size, max_tokens, kind, head_group, vocab_size]");
    num_heads = sizes[0], num_kv_heads = sizes[1], head_dim = sizes[2];
    intermediate_size = sizes[3], group_size = sizes[4], max_tokens = sizes[5];
    head_group = sizes[7], vocab_size = sizes[8];
    TORCH_CHECK(head_group >= 0 && head_group % 32 == 0, kName,
                ": head_group must be 0 or a multiple of 32");
    if (head_group > 0) {  // the last four weights: the embedding's and the LM head's
      TORCH_CHECK(weights.size() > 4, kName, ": the embedding and the LM head are missing");
      TORCH_CHECK(vocab_size > 0 && vocab_size <= kArgmaxMaxValues, kName,
                  ": an LM head of 1 .. ", kArgmaxMaxValues, " rows");
      head_scales = weights.back(), weights.pop_back();
      head_packed = weights.back(), weights.pop_back();
      embed_scales = weights.back(), weights.pop_back();
      embed_packed = weights.back(), weights.pop_back();
    }
    TORCH_CHECK(sizes[6] == static_cast<int64_t>(Kind::kInt4) ||
                    sizes[6] == static_cast<int64_t>(Kind::kBlocked),
                kName, ": kind must be 4 (int4) or 16 (blocked bfloat16)");
    kind = static_cast<Kind>(sizes[6]);
    TORCH_CHECK(kind != Kind::kBlocked || splitfuse_blocked::runs_here(), kName,
                ": this CPU has no AVX-512 BF16 for blocked bfloat16 weights");
    const int64_t block_cols = kind == Kind::kInt4 ? kCols : splitfuse_blocked::kBlockCols;
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0 &&
                    head_dim % 2 == 0 && max_tokens > 0,
                kName, ": bad head counts, head_dim or max_tokens");
    TORCH_CHECK(intermediate_size > 0 && intermediate_size % block_cols == 0, kName,
                ": intermediate_size must be a multiple of ", block_cols);
    const size_t per_layer = 2 + 4 * (kind == Kind::kInt4 ? 3 : 1);
    TORCH_CHECK(weights.size() >= per_layer + 1 && (weights.size() - 1) % per_layer == 0, kName,
                ": weights must be ", per_layer, " tensors a layer and the final norm's");
    TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim && cos_sin.is_contiguous() &&
                    cos_sin.scalar_type() == at::kFloat && cos_sin.device().is_cpu(),
                kName, ": cos_sin must be a contiguous float32 [max_position, head_dim]");
    const at::Tensor& last = weights.back();
    TORCH_CHECK(last.dim() == 1 && last.device().is_cpu() &&
                    (last.scalar_type() == at::kFloat || last.scalar_type() == at::kBFloat16),
                kName, ": the norms' weights must be float32 or bfloat16 CPU vectors");
    dtype = last.scalar_type();
    TORCH_CHECK(kind == Kind::kInt4 || dtype == at::kBFloat16, kName,
                ": blocked weights multiply bfloat16 activations");
    hidden_size = last.size(0);
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    final_norm = norm_weight(last);
    if (head_group > 0) {
      const int64_t blocks = (vocab_size + kCols - 1) / kCols;
      TORCH_CHECK(vocab_size > 0 && hidden_size % head_group == 0, kName,
                  ": vocab_size must be positive and head_group divide ", hidden_size);
      for (const auto& [packed, scales, name] :
           {std::tuple{&embed_packed, &embed_scales, "embedding"},
            {&head_packed, &head_scales, "LM head"}})
        TORCH_CHECK(packed->dim() == 2 && packed->size(0) == blocks &&
                        packed->size(1) == hidden_size * kCols && packed->is_contiguous() &&
                        packed->scalar_type() == at::kByte && packed->device().is_cpu() &&
                        scales->dim() == 3 && scales->size(0) == blocks &&
                        scales->size(1) == hidden_size / head_group && scales->size(2) == kCols &&
                        scales->is_contiguous() && scales->scalar_type() == at::kHalf &&
                        scales->device().is_cpu(),
                    kName, ": the ", name, " must be packed as PackedInt8: uint8 [", blocks, ", ",
                    hidden_size * kCols, "] with float16 scales [", blocks, ", ", hidden_size,
                    " / head_group, 16]");
    }
    for (size_t at = 0; at + 1 < weights.size(); at += per_layer) {
      Layer layer;
      layer.input_norm = norm_weight(weights[at]);
      layer.post_norm = norm_weight(weights[at + 1]);
      size_t next = at + 2;
      layer.qkv = product(weights, next, q_size + 2 * kv_size, hidden_size);
      layer.o = product(weights, next, hidden_size, q_size);
      layer.gate_up = product(weights, next, 2 * intermediate_size, hidden_size);
      layer.down = product(weights, next, hidden_size, intermediate_size);
      layers.push_back(std::move(layer));
    }
  }

  std::vector<float> norm_weight(const at::Tensor& w) const {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden_size && w.scalar_type() == dtype &&
                    w.device().is_cpu(),
                kName, ": a norm's weight must be [", hidden_size, "] in the activations' dtype");
    const at::Tensor as_float = w.to(at::kFloat).contiguous();
    const float* p = as_float.data_ptr<float>();
    return std::vector<float>(p, p + hidden_size);
  }

  // The product whose tensors start at weights[at]; `at` moves past them.
  Product product(const std::vector<at::Tensor>& weights, size_t& at, int64_t out_features,
                  int64_t in_features) const {
    Product p;
    p.out_features = out_features, p.in_features = in_features;
    if (kind == Kind::kBlocked) {
      const at::Tensor& w = weights[at++];
      p.tensors = {w};
      p.block_cols = splitfuse_blocked::kBlockCols;
      TORCH_CHECK(out_features % p.block_cols == 0 && in_features % 2 == 0 && w.dim() == 4 &&
                      w.is_contiguous() && w.scalar_type() == at::kBFloat16 &&
                      w.device().is_cpu() && w.size(0) == p.blocks() &&
                      w.size(1) * 2 == in_features && w.size(2) == p.block_cols &&
                      w.size(3) == 2,
                  kName, ": blocked weight ", at - 1, " must be contiguous bfloat16 [",
                  out_features / p.block_cols, ", ", in_features / 2, ", ", p.block_cols, ", 2]");
      p.blocked_ptr = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      return p;
    }
    p.tensors = {weights[at], weights[at + 1], weights[at + 2]};
    at += 3;
    p.block_cols = kCols;
    const at::Tensor &packed = p.tensors[0], &scales = p.tensors[1], &mins = p.tensors[2];
    const int64_t blocks = p.blocks();
    TORCH_CHECK(in_features % group_size == 0 && group_size % 32 == 0, kName,
                ": group_size must be a multiple of 32 dividing ", in_features);
    TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                    packed.size(0) == blocks && packed.size(1) == in_features * 8 &&
                    packed.device().is_cpu(),
                kName, ": weight ", at - 3, " must be contiguous uint8 [", blocks, ", ",
                in_features * 8, "]");
    for (const at::Tensor* t : {&scales, &mins})
      TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kHalf &&
                      t->size(0) == blocks && t->size(1) == in_features / group_size &&
                      t->size(2) == kCols && t->device().is_cpu(),
                  kName, ": the scales and mins of weight ", at - 3,
                  " must be contiguous float16 [", blocks, ", ", in_features / group_size, ", ",
                  kCols, "]");
    p.packed_ptr = packed.data_ptr<uint8_t>();
    p.scales_ptr = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    p.mins_ptr = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
    return p;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // The final norm's output [T, hidden_size] in the activations' dtype for the decode tokens'
  // embeddings hidden [T, hidden_size]: row t of the step (query_start [T + 1] = 0, 1, .., T)
  // is token t, at position positions[t] = context_lens[t] - 1, which stores its K/V into
  // slots[t] (the slot of that position in row t of block_tables [T, max_blocks], or -1: not
  // stored) and attends to positions 0 .. context_lens[t] - 1. kv_cache [num_layers, 2,
  // num_blocks, block_size, num_kv_heads, head_dim] in the activations' dtype.
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor kv_cache,
                 const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& query_start, const at::Tensor& context_lens) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size && hidden.size(0) >= 1 &&
                    hidden.size(0) <= max_tokens && hidden.scalar_type() == dtype &&
                    hidden.device().is_cpu(),
                kName, ": hidden must be [1 .. ", max_tokens, ", ", hidden_size, "] in ", dtype);
    return step(hidden, false, positions, kv_cache, slots, block_tables, query_start,
                context_lens);
  }

  // The step's logits [T, vocab_size] float32 (the LM head's float32 sums, not rounded to the
  // activations' dtype: as the model's quantized head gives them) from its token ids input_ids
  // [T] (int64), where the stack holds the embedding and the LM head (head_group > 0), and each
  // row's argmax [T] int64 as torch.argmax takes it (greedy sampling's token: each thread takes
  // it over the columns it computed while they are in its caches); the rest as run.
  std::tuple<at::Tensor, at::Tensor> logits(const at::Tensor& input_ids,
                                            const at::Tensor& positions, at::Tensor kv_cache,
                                            const at::Tensor& slots,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& query_start,
                                            const at::Tensor& context_lens) {
    TORCH_CHECK(head_group > 0, kName, ": this stack holds no embedding and LM head");
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.size(0) >= 1 &&
                    input_ids.size(0) <= max_tokens && input_ids.is_contiguous() &&
                    input_ids.scalar_type() == at::kLong && input_ids.device().is_cpu(),
                kName, ": input_ids must be int64 [1 .. ", max_tokens, "]");
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < input_ids.size(0); ++t)
      TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab_size, kName, ": token ", t, " is id ", ids[t],
                  " of a vocabulary of ", vocab_size);
    at::Tensor greedy = at::empty({input_ids.size(0)}, input_ids.options());
    at::Tensor logits = step(input_ids, true, positions, kv_cache, slots, block_tables,
                             query_start, context_lens, &greedy);
    return {logits, greedy};
  }

  // Several decode steps of greedy tokens, [num_steps, T] int64: row k holds step k's argmax,
  // which is step k + 1's input (step 0's is input_ids [T]); positions, slots and context_lens
  // are [num_steps, T], row k as logits takes them for step k (block_tables and query_start
  // serve every step). Every step's inputs are checked before the first runs.
  at::Tensor greedy_steps(const at::Tensor& input_ids, const at::Tensor& positions,
                          at::Tensor kv_cache, const at::Tensor& slots,
                          const at::Tensor& block_tables, const at::Tensor& query_start,
                          const at::Tensor& context_lens) {
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) >= 1 && slots.dim() == 2 &&
                    context_lens.dim() == 2 && slots.size(0) == positions.size(0) &&
                    context_lens.size(0) == positions.size(0),
                kName, ": positions, slots and context_lens must be [num_steps, T]");
    const int64_t num_steps = positions.size(0), T = input_ids.size(0);
    for (int64_t k = 0; k < num_steps; ++k)
      check(T, positions[k], kv_cache, slots[k], block_tables, query_start, context_lens[k]);
    at::Tensor out = at::empty({num_steps, T}, input_ids.options());
    at::Tensor ids = input_ids;
    for (int64_t k = 0; k < num_steps; ++k) {
      ids = std::get<1>(logits(ids, positions[k], kv_cache, slots[k], block_tables, query_start,
                               context_lens[k]));
      out[k].copy_(ids);
    }
    return out;
  }

 private:
  // run (tokens: the embeddings) or logits (tokens: the ids), checked but for the step's indices
  // (greedy: where given, [T] int64 for the logits' argmax)
  at::Tensor step(const at::Tensor& tokens, bool from_ids, const at::Tensor& positions,
                  at::Tensor kv_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                  const at::Tensor& query_start, const at::Tensor& context_lens,
                  at::Tensor* greedy = nullptr) {
    const int64_t T = tokens.size(0), H = hidden_size, D = head_dim;
    check(T, positions, kv_cache, slots, block_tables, query_start, context_lens);
    const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, I = intermediate_size;
    const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
    const int64_t layer_elems = num_blocks * block_size * kv_size;  // one layer's K (or V)
    const bool bf16 = dtype == at::kBFloat16;
    // the cache's kind as the fixed-order kernel numbers it: 0 float32, 1 bfloat16, 2 float16,
    // 3 float8 e4m3fn
    const int cache_kind = splitfuse_fixed_order::cache_kind(kv_cache.scalar_type());
    const auto to_act = [bf16](float v) { return bf16 ? round_bf16(v) : v; };

    // shared between the threads, floats holding values of the activations' dtype
    std::vector<float> x(T * H), qkv(T * qkv_size), query(T * q_size), attended(T * q_size);
    std::vector<float> projected(T * H), gate_up(T * 2 * I), act(T * I);
    if (from_ids) {  // the embedding's rows, as the model rounds them to the activations' dtype
      // (PackedInt8: value k of row n is byte (k / 4) * 64 + c * 4 + k % 4 of block b, minus
      // 128, with n = 16 b + c; its scale is entry c of the block's group k / head_group)
      const int64_t* ids = tokens.data_ptr<int64_t>();
      const uint8_t* packed = embed_packed.data_ptr<uint8_t>();
      const auto* scales = reinterpret_cast<const uint16_t*>(embed_scales.data_ptr<at::Half>());
      const int64_t groups = H / head_group;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t block = ids[t] / kCols, c = ids[t] % kCols;
        const uint8_t* values = packed + block * H * kCols + c * 4;
        const uint16_t* row_scales = scales + block * groups * kCols + c;
        for (int64_t g = 0; g < groups; ++g) {  // (no division by head_group per value)
          const float row_scale = half_to_float(row_scales[g * kCols]);
          for (int64_t k = g * head_group; k < (g + 1) * head_group; ++k) {
            const int value = static_cast<int>(values[k / 4 * 64 + k % 4]) - 128;
            x[t * H + k] = to_act(static_cast<float>(value) * row_scale);
          }
        }
      }
    } else {
      const at::Tensor hidden_f = tokens.to(at::kFloat).contiguous();
      std::memcpy(x.data(), hidden_f.data_ptr<float>(), sizeof(float) * T * H);
    }
    at::Tensor out = from_ids ? at::empty({T, vocab_size}, tokens.options().dtype(at::kFloat))
                              : at::empty({T, H}, tokens.options().dtype(dtype));

    const int64_t* position = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const float* cos_sin_ptr = cos_sin.data_ptr<float>();
    char* cache = static_cast<char*>(kv_cache.data_ptr());
    const int64_t elem = kv_cache.element_size();
    const int64_t table_stride = block_tables.size(1);
    std::vector<int32_t> rows(T);
    for (int64_t t = 0; t < T; ++t) rows[t] = static_cast<int32_t>(t);
    const splitfuse_int4::Int4Kernels& int4 = splitfuse_int4::int4_kernels();
    const int threads = std::max(1, at::get_num_threads());
    const int64_t kv_per_item = T >= kWholeTokenItems * threads ? num_kv_heads : 1;
    const int64_t num_items = T * (num_kv_heads / kv_per_item);
    const int64_t G = num_heads / num_kv_heads, half = D / 2;
    const float scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
    // each thread's own: the residual stream (the same values in every thread), a product's
    // input rows and those rows as the product reads them (int4: rounded to int8, with a scale
    // and a sum per run of 32; blocked: bfloat16 bits), a rotated key, a block's bfloat16 out
    const int64_t max_in = std::max({H, q_size, I});
    const int64_t block_out = T * splitfuse_blocked::kBlockCols;
    const int64_t own_floats = T * H + T * max_in + 2 * (T * max_in / 32) + D;
    const int64_t own_bytes = T * max_in * 2 + block_out * 2;
    std::vector<float> own(threads * own_floats);
    std::vector<uint8_t> own_rows(threads * own_bytes);
    const int64_t block_cols = layers.front().qkv.block_cols;
    const int64_t gate_blocks = I / block_cols;  // the gate's column blocks (the up's follow)
    // from kShareRows tokens the threads prepare a product's input rows between them, into
    // buffers they share, and meet at one more barrier before the product
    const bool share_rows = threads > 1 && T >= kShareRows;
    std::vector<uint8_t> shared_rows(share_rows ? T * max_in * 2 : 0);
    std::vector<float> shared_runs(share_rows ? 2 * (T * max_in / 32) : 0);

    const bool int8 = kind == Kind::kInt4;
    // the work the threads share out (Claims): per layer its 4 products' units and attention's
    // items, then the LM head's units
    const int64_t head_units =
        (vocab_size + kCols * kHeadUnitBlocks - 1) / (kCols * kHeadUnitBlocks);
    enum Phase { kQkv, kAttention, kO, kGateUp, kDown, kPhases };
    const auto units = [](int64_t blocks) { return (blocks + kUnitBlocks - 1) / kUnitBlocks; };
    const int64_t num_claims = num_layers() * kPhases + 1;
    std::unique_ptr<Claims::Ends[]> ends(new Claims::Ends[num_claims * threads]);
    std::vector<Claims> claims;
    claims.reserve(num_claims);
    for (int64_t i = 0; i < num_claims; ++i) claims.emplace_back(ends.get() + i * threads);
    // each LM head unit's argmax of each row (index -1: none)
    std::vector<RangeArgmax> argmaxes(greedy != nullptr ? head_units * T : 0, {-1, 0.0f, false});
    // the threads' meetings (made once the region's thread count is known): a waiting thread
    // spins on one cache line; ~35 us a step less waiting than OpenMP's barrier at one stream's
    // 150 meetings a step
    std::optional<SpinBarrier> meeting;
#pragma omp parallel num_threads(threads)
    {
      const int P = omp_get_num_threads(), me = omp_get_thread_num();
#pragma omp single
      {  // (a single ends at a barrier)
        meeting.emplace(P);
        for (int64_t l = 0; l < num_layers(); ++l) {
          const Layer& layer = layers[l];
          claims[l * kPhases + kQkv].reset(units(layer.qkv.blocks()), P);
          claims[l * kPhases + kAttention].reset(num_items, P);
          claims[l * kPhases + kO].reset(units(layer.o.blocks()), P);
          claims[l * kPhases + kGateUp].reset(units(gate_blocks), P);
          claims[l * kPhases + kDown].reset(units(layer.down.blocks()), P);
        }
        claims.back().reset(head_units, P);
      }
      const auto barrier = [&] { meeting->wait(); };
      // work(begin, end) on each run of this thread's units of `c` (n units) in turn, its own
      // share taken in about `parts` chunks
      const auto each = [&](Claims& c, int64_t n, int64_t parts, const auto& work) {
        const int64_t chunk = std::max<int64_t>(1, ((n + P - 1) / P + parts - 1) / parts);
        for (;;) {
          const auto [u0, u1] = c.take(me, chunk);
          if (u0 >= u1) return;
          work(u0, u1);
        }
      };
      // work(block_begin, block_end) on this thread's column blocks of a product of `blocks`
      const auto each_blocks = [&](Claims& c, int64_t blocks, int64_t parts, const auto& work) {
        each(c, units(blocks), parts, [&](int64_t u0, int64_t u1) {
          work(u0 * kUnitBlocks, std::min(blocks, u1 * kUnitBlocks));
        });
      };
      // the column blocks of this thread's own share of a product of `blocks` (each_blocks
      // takes them first)
      const auto own_blocks = [&](int64_t blocks) {
        const auto [u0, u1] = share(units(blocks), P, me);
        return std::pair<int64_t, int64_t>{std::min(blocks, u0 * kUnitBlocks),
                                           std::min(blocks, u1 * kUnitBlocks)};
      };
      const auto take_one = [&](Claims& c) {
        const auto [k, end] = c.take(me, 1);
        return k < end ? k : int64_t{-1};
      };
      int64_t first_item = -1;  // the attention item a layer's product asks for (many tokens)
      float* residual = own.data() + me * own_floats;
      float* rows_in = residual + T * H;
      float* d8 = rows_in + T * max_in;
      float* s8 = d8 + T * max_in / 32;
      float* key = s8 + T * max_in / 32;
      int8_t* q8 = reinterpret_cast<int8_t*>(own_rows.data() + me * own_bytes);
      auto* x16 = reinterpret_cast<uint16_t*>(own_rows.data() + me * own_bytes);
      auto* out16 = x16 + T * max_in;
      if (share_rows) {
        q8 = reinterpret_cast<int8_t*>(shared_rows.data());
        x16 = reinterpret_cast<uint16_t*>(shared_rows.data());
        d8 = shared_runs.data();
        s8 = d8 + T * max_in / 32;
      }
      alignas(64) float tile_out[4 * 64];

      // rows_in = round(round(rms_norm(in + residual)) * w); residual = the sum (in alone in
      // the first layer)
      const auto norm = [&](const std::vector<float>& w, const float* in, bool first) {
        for (int64_t t = 0; t < T; ++t)
          norm_row(in + t * H, residual + t * H, w.data(), rows_in + t * H, H, eps, first, bf16);
      };
      // the rows in[T, K] as the products read them: each thread all of them for itself, or
      // (share_rows) its share of them for every thread, then the threads meet (a product ends
      // at a barrier, so none still reads the rows prepared before)
      // (int8 rows for a 4-bit product and the LM head, bfloat16 bits for a blocked product)
      const auto prepare = [&](const float* in, int64_t K, bool int8) {
        const auto [r0, r1] = share_rows ? share(T, P, me) : std::pair<int64_t, int64_t>{0, T};
        if (int8) {
          int4.quantize_floats(in, K, r0, r1, q8, d8, s8);
        } else {  // bfloat16 values: their bits
          for (int64_t i = r0 * K; i < r1 * K; ++i) x16[i] = bf16_bits(in[i]);
        }
        if (share_rows) barrier();
      };
      // this thread's column blocks [block_begin, block_end) of product_out [T, N] = the rows
      // last prepared times the weight, rounded to the activations' dtype
      const auto multiply = [&](const Product& p, float* product_out, int64_t block_begin,
                                int64_t block_end) {
        if (block_begin >= block_end) return;
        const int64_t N = p.out_features, K = p.in_features;
        if (kind == Kind::kBlocked) {  // bfloat16 out, rounded once
          const int64_t C = p.block_cols;
          for (int64_t b = block_begin; b < block_end; ++b) {
            splitfuse_blocked::block_product(x16, T, K, p.blocked_ptr + b * C * K, out16, C);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t c = 0; c < C; ++c)
                product_out[t * N + b * C + c] = bfloat16_to_float(out16[t * C + c]);
          }
          return;
        }
        int4.columns(q8, d8, s8, T, K, N, p.packed_ptr, p.scales_ptr, p.mins_ptr, group_size,
                     block_begin, block_end, tile_out, product_out);
        const int64_t col_begin = block_begin * kCols, col_end = std::min(N, block_end * kCols);
        for (int64_t t = 0; t < T; ++t)
          round_into(product_out + t * N + col_begin, product_out + t * N + col_begin,
                     col_end - col_begin, bf16);
      };

      for (int64_t l = 0; l < num_layers(); ++l) {
        const Layer& layer = layers[l];
        char* keys = cache + (2 * l) * layer_elems * elem;
        char* values = cache + (2 * l + 1) * layer_elems * elem;

        norm(layer.input_norm, x.data(), l == 0);
        prepare(rows_in, H, int8);
        const splitfuse_fixed_order::FixedOrderArgs args{
            query.data(), keys,          values,       tables,     rows.data(),
            lens,         attended.data(), T,          q_size,     table_stride,
            kv_size,      block_size,    num_heads,    num_kv_heads, D,
            kv_per_item,  scale,         cache_kind};  // float32 queries
        Claims& items = claims[l * kPhases + kAttention];
        const int64_t qkv_blocks = layer.qkv.blocks();
        if (T > kTouchTokens) {
          // many tokens: the arithmetic bounds the product and the memory sits idle, so this
          // thread takes its first attention item now and asks for its context a share after
          // each of kEarlyParts runs of the product's column blocks (attention's later items
          // are asked for by the item before them; the first one waited on memory)
          first_item = take_one(items);
          int64_t part = 0;
          each_blocks(claims[l * kPhases + kQkv], qkv_blocks, kEarlyParts,
                      [&](int64_t b0, int64_t b1) {
                        multiply(layer.qkv, qkv.data(), b0, b1);
                        if (first_item >= 0 && part < kEarlyParts)
                          splitfuse_fixed_order::ask_for_item(args, first_item, part++,
                                                              kEarlyParts);
                      });
        } else {
          first_item = -1;
          each_blocks(claims[l * kPhases + kQkv], qkv_blocks, kChunks,
                      [&](int64_t b0, int64_t b1) { multiply(layer.qkv, qkv.data(), b0, b1); });
        }
        barrier();
        // a few tokens' contexts loaded into the caches, one byte a line (every KV head's),
        // the threads sharing the blocks; the positions before each token's own, which its
        // attention item stores now
        if (T <= kTouchTokens) {
          const auto [c0, c1] = share(T * table_stride, P, me);
          splitfuse_fixed_order::touch_items(args, c0, c1, 1);
        }
        // this thread's attention items, each first rotary on its query and key heads and its
        // K/V stored (x * cos + rotate_half(x) * sin): only the item's own token attends to
        // them. Items of a token's every KV head take their successor before they compute, so
        // that they ask for its context meanwhile.
        const bool ahead = kv_per_item == num_kv_heads;
        for (int64_t k = first_item >= 0 ? first_item : take_one(items); k >= 0;) {
          const auto [t, kv0] = splitfuse_fixed_order::item_of(args, k);
          const float* cos = cos_sin_ptr + position[t] * D;
          const float* sin = cos + half;
          const float* row = qkv.data() + t * qkv_size;
          for (int64_t kv = kv0; kv < kv0 + kv_per_item; ++kv) {
            for (int64_t h = kv * G; h < (kv + 1) * G; ++h)
              rotate_head(row + h * D, cos, sin, query.data() + t * q_size + h * D, half, bf16);
            if (slot[t] < 0) continue;
            rotate_head(row + q_size + kv * D, cos, sin, key, half, bf16);
            const float* value = row + q_size + kv_size + kv * D;
            const int64_t at = (slot[t] * num_kv_heads + kv) * D;
            if (cache_kind == 1) {
              auto* k_out = reinterpret_cast<uint16_t*>(keys) + at;
              auto* v_out = reinterpret_cast<uint16_t*>(values) + at;
              // (rounded already where the activations are bfloat16)
              for (int64_t i = 0; i < D; ++i) k_out[i] = bf16_bits(round_bf16(key[i]));
              for (int64_t i = 0; i < D; ++i) v_out[i] = bf16_bits(round_bf16(value[i]));
            } else if (cache_kind == 2) {  // to nearest even, as torch's conversion
              auto* k_out = reinterpret_cast<c10::Half*>(keys) + at;
              auto* v_out = reinterpret_cast<c10::Half*>(values) + at;
              for (int64_t i = 0; i < D; ++i) k_out[i] = c10::Half(key[i]);
              for (int64_t i = 0; i < D; ++i) v_out[i] = c10::Half(value[i]);
            } else if (cache_kind == 3) {  // to nearest even, +-448 beyond: torch's conversion
              auto* k_out = reinterpret_cast<c10::Float8_e4m3fn*>(keys) + at;
              auto* v_out = reinterpret_cast<c10::Float8_e4m3fn*>(values) + at;
              for (int64_t i = 0; i < D; ++i) k_out[i] = c10::Float8_e4m3fn(key[i]);
              for (int64_t i = 0; i < D; ++i) v_out[i] = c10::Float8_e4m3fn(value[i]);
            } else {
              std::memcpy(reinterpret_cast<float*>(keys) + at, key, sizeof(float) * D);
              std::memcpy(reinterpret_cast<float*>(values) + at, value, sizeof(float) * D);
            }
          }
          const int64_t next = ahead ? take_one(items) : -1;
          splitfuse_fixed_order::attend_items(args, k, k + 1, next);
          k = ahead ? next : take_one(items);
        }
        if (kind == Kind::kInt4 && T <= kTouchTokens) {
          // A few tokens' attention is a few items (one token's: one), and a thread without
          // one would wait here while the memory sits idle: it asks for its own shares of the
          // next two products' bytes meanwhile (the ones it multiplies first) into its L2
          // cache. Engines alternating with and without (10 rounds of 48 steps from context
          // 256, medians), a token's time with it against without: held to AVX2 one stream
          // 0.94-1.03x in six engines (five faster), 8 streams 0.98x; with AVX-512 one stream
          // 0.95-1.01x in three.
          Fetches fetches;
          // (a 4-bit column block: kCols x K nibbles, K * 8 bytes; a scale and a min a group
          // and column)
          const auto fetch = [&](const Product& p, int64_t b0, int64_t b1) {
            const int64_t K = p.in_features, groups = K / group_size;
            fetches.add(p.packed_ptr + b0 * K * 8, (b1 - b0) * K * 8);
            fetches.add(p.scales_ptr + b0 * groups * kCols, (b1 - b0) * groups * kCols * 2);
            fetches.add(p.mins_ptr + b0 * groups * kCols, (b1 - b0) * groups * kCols * 2);
          };
          const auto [o0, o1] = own_blocks(layer.o.blocks());
          fetch(layer.o, o0, o1);
          const auto [g0, g1] = own_blocks(gate_blocks);  // the gate's, and the up's after it
          fetch(layer.gate_up, g0, g1);
          fetch(layer.gate_up, gate_blocks + g0, gate_blocks + g1);
          meeting->wait([&] { return fetches.next(); });
        } else {
          barrier();
        }
        round_into(attended.data(), rows_in, T * q_size, bf16);
        prepare(rows_in, q_size, int8);
        each_blocks(claims[l * kPhases + kO], layer.o.blocks(), kChunks,
                    [&](int64_t b0, int64_t b1) { multiply(layer.o, projected.data(), b0, b1); });
        barrier();
        norm(layer.post_norm, projected.data(), false);
        prepare(rows_in, H, int8);
        // gate column blocks [g0, g1) and the up blocks I apart, then SiLU(gate) * up there
        each_blocks(claims[l * kPhases + kGateUp], gate_blocks, kChunks,
                    [&](int64_t g0, int64_t g1) {
                      multiply(layer.gate_up, gate_up.data(), g0, g1);
                      multiply(layer.gate_up, gate_up.data(), gate_blocks + g0, gate_blocks + g1);
                      for (int64_t t = 0; t < T; ++t) {
                        const float* gate = gate_up.data() + t * 2 * I + g0 * block_cols;
                        silu_mul(gate, gate + I, act.data() + t * I + g0 * block_cols,
                                 (g1 - g0) * block_cols, bf16);
                      }
                    });
        barrier();
        prepare(act.data(), I, int8);
        each_blocks(claims[l * kPhases + kDown], layer.down.blocks(), kChunks,
                    [&](int64_t b0, int64_t b1) { multiply(layer.down, x.data(), b0, b1); });
        barrier();
      }
      if (from_ids) {
        // every thread the final norm and its rows rounded to int8, then the LM head's column
        // blocks a unit at a time, each unit's argmax of each row taken while it is cached
        norm(final_norm, x.data(), false);
        prepare(rows_in, H, true);
        const int64_t head_blocks = (vocab_size + kCols - 1) / kCols;
        float* logits_ptr = out.data_ptr<float>();
        each(claims.back(), head_units, head_units, [&](int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t b0 = u * kHeadUnitBlocks;
            const int64_t b1 = std::min(head_blocks, b0 + kHeadUnitBlocks);
            int4.columns8(q8, d8, s8, T, H, vocab_size, head_packed.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(head_scales.data_ptr<at::Half>()),
                          head_group, b0, b1, tile_out, logits_ptr);
            const int64_t c0 = b0 * kCols, c1 = std::min(vocab_size, b1 * kCols);
            if (greedy != nullptr)
              for (int64_t t = 0; t < T; ++t)
                argmaxes[u * T + t] = range_argmax(logits_ptr + t * vocab_size, c0, c1);
          }
        });
      } else if (me == 0) {
        norm(final_norm, x.data(), false);
        if (bf16) {
          auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
          for (int64_t i = 0; i < T * H; ++i) o[i] = bf16_bits(rows_in[i]);
        } else {
          std::memcpy(out.data_ptr<float>(), rows_in, sizeof(float) * T * H);
        }
      }
    }
    if (greedy != nullptr) {  // the units' ranges in column order
      int64_t* ids = greedy->data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) {
        RangeArgmax best{-1, 0.0f, false};
        for (int64_t u = 0; u < head_units; ++u) {
          const RangeArgmax& part = argmaxes[u * T + t];
          if (part.index >= 0) best = best.index < 0 ? part : join_ranges(best, part);
        }
        ids[t] = best.index;
      }
    }
    return out;
  }


  // the step's indices, for T tokens
  void check(int64_t T, const at::Tensor& positions, const at::Tensor& kv_cache,
             const at::Tensor& slots, const at::Tensor& block_tables,
             const at::Tensor& query_start, const at::Tensor& context_lens) const {
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() &&
                    kv_cache.size(0) == num_layers() && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == num_kv_heads && kv_cache.size(5) == head_dim &&
                    splitfuse_fixed_order::cache_kind(kv_cache.scalar_type()) >= 0 &&
                    kv_cache.device().is_cpu(),
                kName, ": kv_cache must be a contiguous [", num_layers(), ", 2, num_blocks, "
                "block_size, ", num_kv_heads, ", ", head_dim, "] float32, bfloat16, float16 or "
                "float8_e4m3fn tensor");
    const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.is_contiguous() &&
                    positions.scalar_type() == at::kLong && positions.device().is_cpu(),
                kName, ": positions must be int64 [", T, "]");
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous() &&
                    slots.scalar_type() == at::kLong && slots.device().is_cpu(),
                kName, ": slots must be int64 [", T, "]");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == T &&
                    block_tables.size(1) >= 1 && block_tables.is_contiguous() &&
                    block_tables.scalar_type() == at::kInt && block_tables.device().is_cpu(),
                kName, ": block_tables must be contiguous int32 [", T, ", max_blocks]");
    TORCH_CHECK(query_start.dim() == 1 && query_start.size(0) == T + 1 &&
                    query_start.is_contiguous() && query_start.scalar_type() == at::kInt &&
                    query_start.device().is_cpu(),
                kName, ": query_start must be int32 [", T + 1, "]");
    TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == T &&
                    context_lens.is_contiguous() && context_lens.scalar_type() == at::kInt &&
                    context_lens.device().is_cpu(),
                kName, ": context_lens must be int32 [", T, "]");
    const int64_t* position = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* starts = query_start.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t table_stride = block_tables.size(1);
    for (int64_t t = 0; t <= T; ++t)
      TORCH_CHECK(starts[t] == t, kName, ": every row must hold one token (query_start[", t,
                  "] is ", starts[t], ")");
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(position[t] >= 0 && position[t] < cos_sin.size(0), kName, ": token ", t,
                  " at position ", position[t], " of ", cos_sin.size(0));
      TORCH_CHECK(slot[t] >= -1 && slot[t] < num_blocks * block_size, kName, ": token ", t,
                  " stores into slot ", slot[t], " of ", num_blocks * block_size);
      TORCH_CHECK(lens[t] >= 1 && lens[t] <= table_stride * block_size, kName, ": token ", t,
                  " attends to ", lens[t], " positions");
      for (int64_t b = 0; b < (lens[t] + block_size - 1) / block_size; ++b)
        TORCH_CHECK(tables[t * table_stride + b] >= 0 && tables[t * table_stride + b] < num_blocks,
                    kName, ": token ", t, " reads block ", tables[t * table_stride + b], " of ",
                    num_blocks);
      // a decode token: its position is its context's last, stored in that position's slot
      TORCH_CHECK(position[t] == lens[t] - 1, kName, ": token ", t, " at position ", position[t],
                  " attends to ", lens[t], " positions");
      const int64_t own = tables[t * table_stride + position[t] / block_size] * block_size +
                          position[t] % block_size;
      TORCH_CHECK(slot[t] == -1 || slot[t] == own, kName, ": token ", t, " stores into slot ",
                  slot[t], ", its position's slot is ", own);
    }
  }
};


// The stack's norm, rotary and SiLU as operators over a step's rows (float32 or bfloat16), for
// a 4-bit model's forward on CPUs (kernels/torch_backend.py): a decode token's numbers are then
// the same bits whether the stack or the graphs compute its step, and a row's never depend on
// the others'.

void check_rows_dtype(const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, ": float32 or bfloat16 CPU tensors only");
}

// (round(round(rms_norm(s)) * weight), s) with s = x + residual rounded to x's dtype (s = x
// without one: then summed is returned empty, s being x itself), as norm_row computes a row
std::tuple<at::Tensor, at::Tensor> rms_norm_rows(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps,
                                                 const std::optional<at::Tensor>& residual) {
  constexpr const char* name = "rms_norm_rows";
  check_rows_dtype(name, x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [T, n] tensor");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, name, ": weight must be [", n, "]");
  if (residual.has_value())
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type() && residual->device().is_cpu(),
                name, ": residual must be a contiguous tensor of x's shape and dtype");
  const bool bf16 = x.scalar_type() == at::kBFloat16, first = !residual.has_value();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const float* w_ptr = w.data_ptr<float>();
  at::Tensor normed = at::empty_like(x);
  at::Tensor summed = first ? x.new_empty({0}) : at::empty_like(x);
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 16384 / n);
  if (bf16) {
    const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint16_t* r_ptr =
        first ? nullptr : reinterpret_cast<const uint16_t*>(residual->data_ptr<at::BFloat16>());
    auto* n_ptr = reinterpret_cast<uint16_t*>(normed.data_ptr<at::BFloat16>());
    auto* s_ptr = first ? nullptr : reinterpret_cast<uint16_t*>(summed.data_ptr<at::BFloat16>());
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(n);
      for (int64_t t = begin; t < end; ++t)
        norm_row_bf16(x_ptr + t * n, first ? nullptr : r_ptr + t * n, w_ptr, n_ptr + t * n,
                      first ? nullptr : s_ptr + t * n, sum.data(), n, e, first);
    });
  } else {
    const float* x_ptr = x.data_ptr<float>();
    float* n_ptr = normed.data_ptr<float>();
    if (!first) summed.copy_(*residual);  // norm_row adds x to it in place
    float* s_ptr = first ? nullptr : summed.data_ptr<float>();
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(first ? n : 0);
      for (int64_t t = begin; t < end; ++t)
        norm_row(x_ptr + t * n, first ? sum.data() : s_ptr + t * n, w_ptr, n_ptr + t * n, n, e,
                 first, false);
    });
  }
  return {normed, summed};
}

// Rotary on heads [T, H, D] (each head's D values contiguous; the tokens, and the heads, any
// stride) with the step's rows cos [T, 1, D] (cos twice) and sin [T, 1, D] ((-sin, sin)),
// float32, as rotate_head computes a head; a contiguous result in the heads' dtype
at::Tensor rotary_rows(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* name = "rotary_rows";
  check_rows_dtype(name, heads);
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1, name,
              ": heads must be [T, H, D] with each head's values contiguous");
  const int64_t T = heads.size(0), H = heads.size(1), D = heads.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, name, ": the head size must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == T && t->size(1) == 1 && t->size(2) == D && t->device().is_cpu(),
                name, ": cos and sin must be contiguous float32 [T, 1, D]");
  const bool bf16 = heads.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({T, H, D}, heads.options());
  const int64_t token_stride = heads.stride(0), head_stride = heads.stride(1);
  const float* c_ptr = cos.data_ptr<float>();
  const float* s_ptr = sin.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / (H * D));
  if (bf16) {
    const auto* h_ptr = reinterpret_cast<const uint16_t*>(heads.data_ptr<at::BFloat16>());
    auto* o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < H; ++h)
          rotate_head_bf16(h_ptr + t * token_stride + h * head_stride, c_ptr + t * D,
                           s_ptr + t * D + half, o_ptr + (t * H + h) * D, half);
    });
  } else {
    const float* h_ptr = heads.data_ptr<float>();
    float* o_ptr = out.data_ptr<float>();
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < H; ++h)
          rotate_head(h_ptr + t * token_stride + h * head_stride, c_ptr + t * D,
                      s_ptr + t * D + half, o_ptr + (t * H + h) * D, half, false);
    });
  }
  return out;
}

// round(round(silu(gate)) * up) of gate_up [T, 2I] (gate, then up) -> [T, I], as silu_mul
at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  constexpr const char* name = "silu_mul_rows";
  check_rows_dtype(name, gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, name,
              ": gate_up must be a contiguous [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const int64_t grain = std::max<int64_t>(1, 8192 / I);
  if (bf16) {
    const auto* g_ptr = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
    auto* o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        silu_mul_bf16(g_ptr + t * 2 * I, g_ptr + t * 2 * I + I, o_ptr + t * I, I);
    });
  } else {
    const float* g_ptr = gate_up.data_ptr<float>();
    float* o_ptr = out.data_ptr<float>();
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        silu_mul(g_ptr + t * 2 * I, g_ptr + t * 2 * I + I, o_ptr + t * I, I, false);
    });
  }
  return out;
}

// Where int4_silu_mul's rows go: row first_row + r of out [M, I] (float32 or bfloat16), its W
// columns from `col`, = round(round(silu(gate)) * up) of the products gate and up (float32 sums
// not yet rounded to x's dtype), as the product, its rounding and silu_mul_rows give them
struct ActRows {
  void* out;
  int64_t I, first_row, col;
  bool bf16;
  float* scratch;  // 3 W floats (CPUs without AVX-512)

  void row(int64_t r, const float* gate, const float* up, int64_t W) const {
    const int64_t at = (first_row + r) * I + col;
    if (!bf16) {
      silu_mul(gate, up, static_cast<float*>(out) + at, W, false);
      return;
    }
    uint16_t* o = static_cast<uint16_t*>(out) + at;
    if (kRowsAvx512) {
      rows_avx512::silu_mul_products(gate, up, o, W);
      return;
    }
    float* g = scratch;
    float* u = g + W;
    float* act = u + W;
    round_into(gate, g, W, true);
    round_into(up, u, W, true);
    silu_mul(g, u, act, W, true);
    for (int64_t c = 0; c < W; ++c) o[c] = bf16_bits(act[c]);
  }

  // amx_int4_gate_up_rows' each_row: a tile row's kCols columns
  static void tile_row(void* context, int64_t r, const float* gate, const float* up) {
    static_cast<const ActRows*>(context)->row(r, gate, up, kCols);
  }

  // amx_blocked_gate_up_rows' each_row: a tile row's kCols columns from `at`
  static void tile_row_at(void* context, int64_t r, int64_t at, const float* gate,
                          const float* up) {
    auto* rows = static_cast<ActRows*>(context);
    rows->col = at;
    rows->row(r, gate, up, kCols);
  }
};

// SwiGLU's silu(gate) * up of x times a gate-and-up 4-bit weight [2I, K] (packed as
// int4_linear's, the gate's I output columns first), in x's dtype: what int4_linear, then the
// rounding to x's dtype, then silu_mul_rows compute, the same bits, in one parallel region.
// The threads take pairs of the gate's column blocks in turn. Integer rows (as int4_linear rounds
// them) multiply a pair and the up's blocks I apart into float32 scratch that stays in its
// caches, and their SiLU is written at once; a step's prompt rows on AMX tiles (where
// int4_linear would put them) take a gate block and its up block at a time, each row's SiLU
// written while the tiles multiply the next rows (amx_int4_gate_up_rows). The [M, 2I] float32
// product, its bfloat16 copy and their reading back never reach memory.
at::Tensor int4_silu_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t intermediate, int64_t group_size) {
  constexpr const char* name = "int4_silu_mul";
  check_rows_dtype(name, x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), I = intermediate;
  TORCH_CHECK(K > 0 && K % 32 == 0, name, ": K=", K, " must be a multiple of 32");
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, name,
              ": group_size ", group_size, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(I > 0 && I % kCols == 0, name, ": intermediate=", I, " must be a multiple of 16");
  const int64_t gate_blocks = I / kCols, groups = K / group_size;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.device().is_cpu() && packed.size(0) == 2 * gate_blocks &&
                  packed.size(1) == K * 8,
              name, ": packed must be contiguous uint8 [", 2 * gate_blocks, ", ", K * 8, "]");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == 2 * gate_blocks && t->size(1) == groups && t->size(2) == kCols &&
                    t->device().is_cpu(),
                name, ": scales and mins must be contiguous float16 [", 2 * gate_blocks, ", ",
                groups, ", 16]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({M, I}, x.options());
  if (M == 0) return out;
  const auto& int4 = splitfuse_int4::int4_kernels();
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  const auto* sc_ptr = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mn_ptr = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  // rows [0, from) as int4_linear's integer products, [from, M) on its tiles
  const int64_t from =
      splitfuse_int4::amx_ready() ? std::min(M, splitfuse_int4::tile_rows_from()) : M;
  // the integer rows as int4_linear rounds them, the tile rows as its tiles read them
  const splitfuse_int4::RoundedRows rounded(x.narrow(0, 0, from));
  const int8_t* q = rounded.q;
  const float* d = rounded.d;
  const float* s = rounded.s;
  const int64_t tiled = M - from;
  const at::Tensor tile_rows =
      tiled > 0 ? splitfuse_int4::tile_rows(x.narrow(0, from, tiled)) : at::Tensor();
  const uint16_t* x16 =
      tiled > 0 ? reinterpret_cast<const uint16_t*>(tile_rows.data_ptr<at::BFloat16>()) : nullptr;
  constexpr int64_t kPair = 2;  // gate blocks a unit of the integer rows' products
  splitfuse_int4::share_units((gate_blocks + kPair - 1) / kPair, [&](const auto& next) {
    alignas(64) float tile_out[16 * 16];
    // the integer rows' gate and up products of a unit's columns, and act's scratch
    std::unique_ptr<float[]> scratch(new float[(2 * from + 3) * kPair * kCols]);
    float* gate = scratch.get();
    float* up = gate + from * kPair * kCols;
    ActRows rows{out.data_ptr(), I, 0, 0, bf16, up + from * kPair * kCols};
    uint16_t* panels = tiled > 0 ? splitfuse_int4::amx_panel_scratch(K) : nullptr;
    TORCH_CHECK(tiled == 0 || panels != nullptr, name, ": out of memory for ", 2 * K * kCols,
                " values");
    alignas(64) float tile_sums[2 * 4 * 256];
    for (int64_t unit = next(); unit >= 0; unit = next()) {
      const int64_t g = unit * kPair, nb = std::min(kPair, gate_blocks - g), W = nb * kCols;
      // block b of the weight
      const auto at_block = [&](int64_t b) {
        return splitfuse_int4::Int4Block{w_ptr + b * K * 8, sc_ptr + b * groups * kCols,
                                         mn_ptr + b * groups * kCols};
      };
      if (from > 0) {
        const auto gb = at_block(g), ub = at_block(gate_blocks + g);
        int4.columns(q, d, s, from, K, W, gb.packed, gb.scales, gb.mins, group_size, 0, nb,
                     tile_out, gate);
        int4.columns(q, d, s, from, K, W, ub.packed, ub.scales, ub.mins, group_size, 0, nb,
                     tile_out, up);
        rows.first_row = 0;
        rows.col = g * kCols;
        for (int64_t r = 0; r < from; ++r) rows.row(r, gate + r * W, up + r * W, W);
      }
      // the tile rows a block at a time, each row's SiLU beside the next rows' products
      for (int64_t b = g; tiled > 0 && b < g + nb; ++b) {
        rows.first_row = from;
        rows.col = b * kCols;
        splitfuse_int4::amx_int4_gate_up_rows(x16, tiled, K, at_block(b),
                                              at_block(gate_blocks + b), group_size, panels,
                                              tile_sums, ActRows::tile_row, &rows);
      }
    }
    if (tiled > 0) splitfuse_int4::amx_release();
  });
  return out;
}

// SwiGLU's silu(gate) * up of bfloat16 x times a bfloat16 gate-and-up weight [2I, K] in oneDNN's
// blocked layout [2I / 64, K / 2, 64, 2] (blocked_linear's; the gate's I output columns first),
// in bfloat16: what blocked_linear, then silu_mul_rows compute (float32 sums rounded once, then
// round(round(silu(gate)) * up)), the same bits, in one parallel region. With AMX tiles (from
// blocked_linear's tile rows on) the threads take a few 16-column quarters of the gate and
// their up quarters at a time (some kTilePanelBytes of the weight), each row's SiLU written
// while the tiles multiply the next rows or quarters (amx_blocked_gate_up_rows; 512 rows x 576
// -> 2 x 1536 on 2 cores of an Intel Xeon: 1.02-1.03 ms apart -> 0.94 ms); elsewhere a
// 64-column block and its up block at a time (block_product). The [M, 2I] product and its
// reading back never reach memory.
at::Tensor blocked_silu_mul(const at::Tensor& x, const at::Tensor& weight, int64_t intermediate) {
  constexpr const char* name = "blocked_silu_mul";
  TORCH_CHECK(splitfuse_blocked::runs_here(), name, ": this CPU has no AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.device().is_cpu(),
              name, ": x must be a contiguous bfloat16 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), I = intermediate;
  constexpr int64_t kBlock = splitfuse_blocked::kBlockCols;
  TORCH_CHECK(I > 0 && I % kBlock == 0, name, ": intermediate=", I, " must be a multiple of 64");
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu() &&
                  weight.size(0) * kBlock == 2 * I && weight.size(1) * 2 == K &&
                  weight.size(2) == kBlock && weight.size(3) == 2,
              name, ": weight must be a contiguous bfloat16 [", 2 * I / kBlock, ", ", K / 2,
              ", 64, 2] CPU tensor");
  at::Tensor out = at::empty({M, I}, x.options());
  if (M == 0) return out;
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w_ptr = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (splitfuse_blocked::on_tiles(M, K)) {
    const at::Tensor rows16 = splitfuse_int4::tile_rows(x);
    const auto* x16 = reinterpret_cast<const uint16_t*>(rows16.data_ptr<at::BFloat16>());
    // units of some kTilePanelBytes of the weight (a gate quarter and its up quarter: as many
    // bytes as a pair), taken as each thread gets to them (share_units)
    const int64_t quarters = I / kCols, per_unit = splitfuse_blocked::tile_unit_pairs(K);
    splitfuse_int4::share_units((quarters + per_unit - 1) / per_unit, [&](const auto& next) {
      float scratch[3 * kCols];
      ActRows rows{out.data_ptr(), I, 0, 0, true, scratch};
      alignas(64) float sums[2 * 4 * 256];
      for (int64_t unit = next(); unit >= 0; unit = next())
        splitfuse_int4::amx_blocked_gate_up_rows(
            x16, M, K, w_ptr, I, unit * per_unit, std::min(quarters, (unit + 1) * per_unit),
            sums, ActRows::tile_row_at, &rows);
      splitfuse_int4::amx_release();
    });
    return out;
  }
  const int64_t blocks = I / kBlock;
  auto* o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // a block's gate products [M, 64] then its up products, as blocked_linear rounds them
    std::unique_ptr<uint16_t[]> products(new uint16_t[2 * M * kBlock]);
    const uint16_t* gate = products.get();
    const uint16_t* up = gate + M * kBlock;
    for (int64_t b = begin; b < end; ++b) {
      splitfuse_blocked::block_product(x_ptr, M, K, w_ptr + b * K * kBlock, products.get(),
                                       kBlock);
      splitfuse_blocked::block_product(x_ptr, M, K, w_ptr + (blocks + b) * K * kBlock,
                                       products.get() + M * kBlock, kBlock);
      for (int64_t r = 0; r < M; ++r)  // silu_mul_rows' arithmetic
        silu_mul_bf16(gate + r * kBlock, up + r * kBlock, o_ptr + r * I + b * kBlock, kBlock);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, double>())
      .def("run", &DecodeStack::run)
      .def("logits", &DecodeStack::logits)
      .def("greedy_steps", &DecodeStack::greedy_steps)
      .def("num_layers", &DecodeStack::num_layers);
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps, Tensor? residual) -> "
        "(Tensor, Tensor)");
  m.def("rotary_rows(Tensor heads, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul_rows(Tensor gate_up) -> Tensor");
  m.def("int4_silu_mul(Tensor x, Tensor packed, Tensor scales, Tensor mins, int intermediate, "
        "int group_size) -> Tensor");
  m.def("blocked_silu_mul(Tensor x, Tensor weight, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) {
  m.impl("rms_norm_rows", rms_norm_rows);
  m.impl("rotary_rows", rotary_rows);
  m.impl("silu_mul_rows", silu_mul_rows);
  m.impl("int4_silu_mul", int4_silu_mul);
  m.impl("blocked_silu_mul", blocked_silu_mul);
}
