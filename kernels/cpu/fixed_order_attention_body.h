// The body of splitfuse_cpu::fixed_order_attention, included once per instruction set by
// fixed_order_attention.cpp. Every number a query's result depends on is computed by the same
// operations in the same order whatever else the call holds:
//   score(q, p)  = sum over head_dim in 16 fixed lanes (lane l adds the dims widened to l,
//                  l + 16, ... (lane_of) with fused multiply-adds), the lanes added as a fixed
//                  tree (lane_trees16), times the scale
//   weight(q, p) = exp(score - max score): a polynomial of fused multiply-adds (exp16_nonpositive)
//   sum          = position p's weight added into lane p % 16, one position after another, the
//                  lanes then added as a fixed tree (lane_tree)
//   out(q)       = per dim, weight * value added one position after another, then / sum
// Only IEEE operations with one rounding each appear (fused multiply-adds spelled out: fma16 and
// std::fma), so a vectorized loop and its scalar remainder give the same bits, and so do the
// AVX-512, AVX2 and plain builds.

// The 16-lane vector's helpers; the AVX2 build defines its own (fixed_order_attention_avx2.h),
// which compute the same lanes.
#ifndef SF_ATTENTION_AVX2
// exp(x) per lane for x <= 0, within ~1 ulp; 0 below -87.3 (where exp leaves the normal
// floats). A lane's result depends on that lane alone.
static inline v16 exp16_nonpositive(v16 x) {
  typedef int32_t vi16 __attribute__((vector_size(64)));
  const v16 low = v16{} - 87.3f;
  const vi16 below = x < low;
  const v16 clamped = below ? low : x;
  // x / ln 2 rounded to an integer n, then r = x - n ln 2 (ln 2 in two parts)
  const v16 shifted = fma16(clamped, v16{} + 1.44269504088896341f, v16{} + 12582912.0f);
  const v16 n = shifted - 12582912.0f;
  v16 r = fma16(n, v16{} - 0.693359375f, clamped);
  r = fma16(n, v16{} + 2.12194440e-4f, r);
  v16 p = v16{} + 1.9875691500e-4f;
  p = fma16(p, r, v16{} + 1.3981999507e-3f);
  p = fma16(p, r, v16{} + 8.3334519073e-3f);
  p = fma16(p, r, v16{} + 4.1665795894e-2f);
  p = fma16(p, r, v16{} + 1.6666665459e-1f);
  p = fma16(p, r, v16{} + 5.0000001201e-1f);
  const v16 r2 = r * r;
  const v16 y = fma16(p, r2, r) + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;  // 2^n, n in [-126, 0]
  v16 power;
  __builtin_memcpy(&power, &bits, sizeof power);
  return below ? v16{} : y * power;
}

static inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// x in every lane: one broadcast (v16{} + x is an addition first: it would turn -0 into +0)
static inline v16 splat16(float x) {
  return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline v16 larger16(v16 a, v16 b) { return a > b ? a : b; }
#endif

// The row of position p of KV head kv in `cache`, through the block table. Where a block holds
// a multiple of kBlock positions, the kBlock positions from a multiple of kBlock lie in one
// block, rows slot_stride apart: row_at(p0) + i * slot_stride is position p0 + i's, one 64-bit
// division for kBlock rows instead of one a row.
template <typename CacheT>
static inline const CacheT* row_at(const CacheT* cache, const FixedOrderArgs& a,
                                   const int32_t* table, int64_t kv, int64_t p) {
  const int64_t slot =
      static_cast<int64_t>(table[p / a.block_size]) * a.block_size + p % a.block_size;
  return cache + slot * a.slot_stride + kv * a.head_dim;
}

#ifndef SF_ATTENTION_AVX2
// The 16 lanes of each of sixteen accumulators added as a fixed tree, all at once: halves,
// quarters, then pairs of lanes, then lanes (lane i of the result is a[i]'s sum). Lanes of
// different accumulators never meet, so an accumulator's sum does not depend on the others.
__attribute__((always_inline)) static inline v16 lane_trees16(const v16* a) {
  v16 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // a[i]'s 8 partial sums, then a[i + 8]'s
    x[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                   21, 22, 23) +
           __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                   28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // quarters: a[i]'s 4, a[i + 4]'s, a[i + 8]'s, a[i + 12]'s
    y[i] = __builtin_shufflevector(x[i], x[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                                   25, 26, 27) +
           __builtin_shufflevector(x[i], x[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                                   29, 30, 31);
  for (int i = 0; i < 2; ++i)  // quarter k: a[i + 4k]'s 2, a[i + 2 + 4k]'s 2
    z[i] = __builtin_shufflevector(y[i], y[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                   13, 28, 29) +
           __builtin_shufflevector(y[i], y[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                   15, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}

// One accumulator's 16 lanes: halves, quarters, then ((0 + 2) + (1 + 3)).
static inline float lane_tree(v16 acc) {
  const v8 eighths = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 quarters = __builtin_shufflevector(eighths, eighths, 0, 1, 2, 3) +
                      __builtin_shufflevector(eighths, eighths, 4, 5, 6, 7);
  return (quarters[0] + quarters[2]) + (quarters[1] + quarters[3]);
}
#endif

// A row of head_dim values is widened to float32 in groups of 32 dims, each laid out as its 16
// even dims then its 16 odd dims (lane_of); a last group of fewer dims keeps its order. The
// layout is bfloat16's cheapest: 32 values read as 16 words give the even dims by a shift and
// the odd ones by a mask. Every cache dtype uses it, so a cache's values, not its dtype, decide
// the result's bits.
static inline int64_t lane_of(int64_t d, int64_t D) {
  if (d >= D / 32 * 32) return d;
  const int64_t r = d % 32;
  return d - r + (r % 2) * 16 + r / 2;
}

#ifndef SF_ATTENTION_AVX2
typedef uint32_t vu16 __attribute__((vector_size(64)));

// 32 values from in: the even dims into even, the odd dims into odd
static inline void split_pairs(const Bf16* in, v16& even, v16& odd) {
  vu16 words;
  __builtin_memcpy(&words, in, sizeof words);
  const vu16 low = words << 16, high = words & 0xFFFF0000u;  // bfloat16 -> float32: exact
  __builtin_memcpy(&even, &low, sizeof even);
  __builtin_memcpy(&odd, &high, sizeof odd);
}

// split_pairs' inverse for bfloat16: the even and the odd dims of 32 values rounded as
// from_float<Bf16> rounds them (to nearest even, NaN as 0x7FC0) and stored in their order
static inline void store_pairs(Bf16* out, v16 even, v16 odd) {
  vu16 e, o;
  __builtin_memcpy(&e, &even, sizeof e);
  __builtin_memcpy(&o, &odd, sizeof o);
  typedef int32_t vi16 __attribute__((vector_size(64)));
  const vi16 even_nan = even != even, odd_nan = odd != odd;
  e = even_nan ? (vu16{} + 0x7FC00000u) : e + (0x7FFFu + ((e >> 16) & 1u));
  o = odd_nan ? (vu16{} + 0x7FC00000u) : o + (0x7FFFu + ((o >> 16) & 1u));
  const vu16 words = (e >> 16) | (o & 0xFFFF0000u);
  __builtin_memcpy(out, &words, sizeof words);
}

static inline void split_pairs(const float* in, v16& even, v16& odd) {
  const v16 lo = load16(in), hi = load16(in + 16);
  even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// split_pairs' inverse for float32: the even and the odd dims of 32 values stored in their order
static inline void store_pairs(float* out, v16 even, v16 odd) {
  store16(out, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                       22, 7, 23));
  store16(out + kLanes, __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                                                13, 29, 14, 30, 15, 31));
}
#endif

// A block's n <= kBlock scores into w: a whole block as one vector (a copy of variable length
// compiled to `rep movsq`, ~6% of a call of 32 decode tokens)
static inline void store_scores(float* w, v16 scores, int64_t n) {
  if (n == kBlock)
    store16(w, scores);
  else
    __builtin_memcpy(w, &scores, n * sizeof(float));
}

// (F16C builds convert float16 and float8 in registers: before this file's inclusion)
#if !SF_F16C
template <typename CacheT>
static inline void split_widened(const CacheT* in, v16& even, v16& odd) {
  float widened[32];
  for (int d = 0; d < 32; ++d) widened[d] = to_float(in[d]);
  split_pairs(widened, even, odd);
}
static inline void split_pairs(const Fp16* in, v16& even, v16& odd) {
  split_widened(in, even, odd);
}
static inline void split_pairs(const Fp8* in, v16& even, v16& odd) {
  split_widened(in, even, odd);
}
static inline void split_pairs_256th(const Fp8* in, v16& even, v16& odd) {
  split_widened(in, even, odd);
  even = even * (1.0f / 256);  // exact
  odd = odd * (1.0f / 256);
}
#endif

template <typename CacheT>
static inline void load_row(const CacheT* in, int64_t n, float* out) {
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    v16 even, odd;
    split_pairs(in + d, even, odd);
    store16(out + d, even);
    store16(out + d + 16, odd);
  }
  for (; d < n; ++d) out[d] = to_float(in[d]);
}

// Positions p0 .. p0 + n - 1 of KV heads [kv0, kv0 + nkv), read through the block table, as
// float rows Dp apart: position i's head j at row i * nkv + j. A slot's heads are contiguous, so
// the item of a token's every KV head reads each block front to back.
template <typename CacheT>
static inline void widen_block(const CacheT* cache, const FixedOrderArgs& a, const int32_t* table,
                               int64_t kv0, int64_t nkv, int64_t p0, int64_t n, int64_t Dp,
                               float* block) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = p0 + i;
    const int64_t slot =
        static_cast<int64_t>(table[p / a.block_size]) * a.block_size + p % a.block_size;
    const CacheT* row = cache + slot * a.slot_stride + kv0 * a.head_dim;
    for (int64_t j = 0; j < nkv; ++j)
      load_row(row + j * a.head_dim, a.head_dim, block + (i * nkv + j) * Dp);
  }
}

// o[c] += w[i] * values[i][c] for i = 0 .. n - 1 in turn, for C chunks of 16 dims at once: C
// chains of fused multiply-adds in flight (each chunk's additions in the same order as alone)
template <int C>
static inline void add_weighted(float* o, const float* values, const float* w, int64_t n,
                                int64_t stride) {
  v16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = load16(o + c * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    const v16 weight = splat16(w[i]);
    for (int c = 0; c < C; ++c)
      acc[c] = fma16(weight, load16(values + i * stride + c * kLanes), acc[c]);
  }
  for (int c = 0; c < C; ++c) store16(o + c * kLanes, acc[c]);
}

// Loads one byte of each cache line of positions p0 .. p0 + n - 1 of KV heads [kv0, kv0 + nkv):
// loads that do not wait on one another, issued before the arithmetic reads those rows (two
// blocks ahead in attend_heads64, one in the buffer path; only reads). A context's blocks lie
// anywhere in the cache, so the hardware prefetcher finds no stream. Software prefetches of the
// same lines gained 0-10% (32 decode tokens at context 272, 2 threads, cold caches), these loads
// ~20%.
// (Inlined, as Ahead::issue: a call between the sums saves and restores the vector registers;
// 32 decode tokens at context 256, the old and the new kernel alternating in one process: 240 ->
// 234 us a call with the contexts in the L3 cache, 303 -> 299 us from memory.)
template <typename CacheT>
__attribute__((always_inline)) static inline void touch_block(
    const CacheT* cache, const FixedOrderArgs& a, const int32_t* table, int64_t kv0, int64_t nkv,
    int64_t p0, int64_t n) {
  const int64_t bytes = nkv * a.head_dim * static_cast<int64_t>(sizeof(CacheT));
  const int64_t stride = a.slot_stride * static_cast<int64_t>(sizeof(CacheT));
  for (int64_t p = p0; p < p0 + n;) {  // the positions of one cache block at a time
    const int64_t run = std::min(p0 + n - p, a.block_size - p % a.block_size);
    const auto* row = reinterpret_cast<const volatile char*>(row_at(cache, a, table, kv0, p));
    for (int64_t i = 0; i < run; ++i, row += stride)
      for (int64_t b = 0; b < bytes; b += 64) (void)row[b];
    p += run;
  }
}

// Scores w[0 .. length) -> exp(score - max score), in place; returns their sum: position p adds
// into lane p % 16, one position after another, and the lanes are added as a tree (a lane's
// missing positions add 0, which changes nothing)
static inline float exponentiate(float* w, int64_t length) {
  const int64_t whole = length / kLanes * kLanes;
  v16 tops = v16{} + w[0];  // the largest score, whatever the order it is found in
  for (int64_t p = 0; p < whole; p += kLanes) {
    const v16 v = load16(w + p);
    tops = larger16(v, tops);
  }
  float top = w[0], lanes[kLanes];
  store16(lanes, tops);
  for (int l = 0; l < kLanes; ++l) top = lanes[l] > top ? lanes[l] : top;
  for (int64_t p = whole; p < length; ++p) top = w[p] > top ? w[p] : top;
  v16 total = {};
  for (int64_t p = 0; p < whole; p += kLanes) {
    const v16 e = exp16_nonpositive(load16(w + p) - top);
    store16(w + p, e);
    total = total + e;
  }
  if (whole < length) {  // the last positions in lanes 0 ..; the other lanes' exp is 0
    for (int l = 0; l < kLanes; ++l) lanes[l] = -INFINITY;
    for (int64_t p = whole; p < length; ++p) lanes[p - whole] = w[p] - top;
    const v16 tail = exp16_nonpositive(load16(lanes));
    store16(lanes, tail);
    for (int64_t p = whole; p < length; ++p) w[p] = lanes[p - whole];
    total = total + tail;
  }
  return lane_tree(total);
}

constexpr int64_t kAhead = 2 * kBlock;  // positions between a touch (touch_block) and its read

// A step of at most kTouchTokens tokens has its contexts loaded into the caches before the
// arithmetic (touch_items, which both callers run first), so the kernels' own touches of its rows
// would only find them there again: they are left out. One decode token at context 256, 30
// layers amid the weights' stream: the first thread's attention 266-271 -> 207-211 us a step
// (measured while each touch was still a call that saved and restored the vector registers).
static inline bool touched_before(const FixedOrderArgs& a) {
  return a.num_tokens <= splitfuse_fixed_order::kTouchTokens;
}

// The context of a thread's next item (its KV heads' key rows, then their value rows), asked
// for into the L2 cache a share at a time while the current item computes: software
// prefetches, which the arithmetic does not wait on as it waits on loads, a whole item ahead
// (the touches of the current item's rows then find them cached). Items of a token's every KV
// head only: a step of few tokens loads its contexts first (touch_items). 32 decode tokens at
// context 256, 2 threads, contexts in memory: 593-742 -> 407-486 us a call.
// With the int4 default model's steps of 32 decode tokens this attention is ~40% of a step, and
// its time sits on these prefetches: with every fill buffer taken they wait, so a context
// arrives at ~15 GB/s where a streaming read of the weights gets ~30 GB/s. Other hints were
// slower (a step at 24.5 ms with this one, the T2 hint alike): T0 26.3 ms, NTA 38 ms, and every
// other line only (leaving its neighbour to the hardware's adjacent-line fetch) 26.9 ms.
struct Ahead {
  const char* keys = nullptr;  // the caches, in bytes
  const char* values = nullptr;
  const int32_t* table = nullptr;  // the next item's row of the block tables
  int64_t length = 0, block_size = 0, slot_bytes = 0;  // a slot: every KV head's row
  int64_t next = 0, per_call = 0;  // positions u = 0 .. 2 * length - 1: keys, then values

  __attribute__((always_inline)) void issue() {
    const int64_t end = std::min(next + per_call, 2 * length);
    while (next < end) {  // the positions of one cache block (of keys or values) at a time
      const int64_t p = next < length ? next : next - length;
      const int64_t run = std::min({end - next, block_size - p % block_size,
                                    next < length ? length - next : end - next});
      const int64_t slot =
          static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      const char* row = (next < length ? keys : values) + slot * slot_bytes;
      for (int64_t b = 0; b < run * slot_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
      next += run;
    }
  }
};

// Heads of 64 dims, bfloat16 or float32 caches: the same arithmetic in the same order as
// buffer_items below (so the same bits), without widening rows into a buffer. Each position's
// key or value row (4 chunks of 16 lanes) is read once into registers for HG query heads of KV
// head kv; the HG x 4 output accumulators stay in registers over the whole context. The rows of
// KV heads kv .. kv + touched - 1 are touched kAhead positions before they are read. 32 decode
// tokens at context 272, 2 threads: 549 -> 473 us a layer with the context in the L3 cache,
// ~700 -> ~560 us from memory.
template <int HG, typename QueryT, typename CacheT>
static void attend_heads64(const FixedOrderArgs& a, const CacheT* keys, const CacheT* values,
                           const int32_t* table, int64_t length, int64_t kv, int64_t touched,
                           const QueryT* const* query_rows, QueryT* const* out_rows,
                           float* weights, Ahead* ahead) {  // ahead: issued each block
  constexpr int64_t D = 64, C = 4;
  const bool whole = a.block_size % kBlock == 0;  // kBlock positions in one block (row_at)
  // position p0 + i's row, p0 a multiple of kBlock, first = row_at(cache, p0) where whole
  auto row_of = [&](const CacheT* cache, const CacheT* first, int64_t p0, int64_t i) {
    return whole ? first + i * a.slot_stride : row_at(cache, a, table, kv, p0 + i);
  };
  auto chunks = [](const CacheT* row, v16* c) {
    split_pairs(row, c[0], c[1]);
    split_pairs(row + 32, c[2], c[3]);
  };
  // float8 rows are read / 256 (split_pairs_256th: four multiplies fewer a row), keys against
  // queries times 256 and values against weights times 256 (scalings by a power of two: exact):
  // each product is the same number, so each fused multiply-add rounds alike and gives the same
  // bits
  constexpr bool read_256th = std::is_same_v<CacheT, Fp8>;
  auto chunks_256th = [&](const CacheT* row, v16* c) {
    if constexpr (read_256th) {
      split_pairs_256th(row, c[0], c[1]);
      split_pairs_256th(row + 32, c[2], c[3]);
    } else {
      chunks(row, c);
    }
  };
  v16 q[HG][C];
  for (int h = 0; h < HG; ++h) {
    float widened[D];
    for (int64_t d = 0; d < D; ++d) widened[lane_of(d, D)] = to_float(query_rows[h][d]);
    for (int c = 0; c < C; ++c)
      q[h][c] = read_256th ? load16(widened + c * kLanes) * 256.0f : load16(widened + c * kLanes);
  }
  // the keys then the values of the context, as positions u = 0 .. 2 * length - 1
  auto touch = [&](int64_t u0, int64_t u1) {
    if (touched == 0) return;
    u1 = std::min(u1, 2 * length);
    if (u0 < length) touch_block(keys, a, table, kv, touched, u0, std::min(u1, length) - u0);
    u0 = std::max(u0, length);
    if (u0 < u1) touch_block(values, a, table, kv, touched, u0 - length, u1 - u0);
  };
  touch(0, kAhead);
  // scores, a block of 16 positions at a time (rows past the context: zeros, lanes dropped)
  for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, length - p0);
    touch(p0 + kAhead, p0 + kAhead + n);
    ahead->issue();
    const CacheT* first = whole ? row_at(keys, a, table, kv, p0) : nullptr;
    v16 acc[HG][kBlock];
    for (int64_t i = 0; i < kBlock; ++i) {
      v16 k[C] = {};
      if (i < n) chunks_256th(row_of(keys, first, p0, i), k);
      for (int h = 0; h < HG; ++h) {
        v16 sum = {};
        for (int c = 0; c < C; ++c) sum = fma16(q[h][c], k[c], sum);
        acc[h][i] = sum;
      }
    }
    for (int h = 0; h < HG; ++h) {
      store_scores(weights + h * length + p0, lane_trees16(acc[h]) * a.scale, n);
    }
  }
  float totals[HG];
  for (int h = 0; h < HG; ++h) totals[h] = exponentiate(weights + h * length, length);
  // out += weight * value, one position after another
  v16 out[HG][C] = {};
  for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, length - p0);
    touch(length + p0 + kAhead, length + p0 + kAhead + n);
    ahead->issue();
    const CacheT* first = whole ? row_at(values, a, table, kv, p0) : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      v16 v[C];
      chunks_256th(row_of(values, first, p0, i), v);
      for (int h = 0; h < HG; ++h) {
        const float w = weights[h * length + p0 + i];
        const v16 weight = splat16(read_256th ? w * 256.0f : w);
        for (int c = 0; c < C; ++c) out[h][c] = fma16(weight, v[c], out[h][c]);
      }
    }
  }
  for (int h = 0; h < HG; ++h) {
    if constexpr (std::is_same_v<QueryT, Bf16> || std::is_same_v<QueryT, float>) {
      // per lane the division (and for bfloat16 the rounding of from_float), 32 dims at a time:
      // the same bits as one value at a time (32 decode tokens at context 256, with the full
      // blocks' scores stored whole: 231 -> 208 us a call in the caches, 309 -> 289 us from
      // memory; float32 queries 235 -> 213 / 319 -> 301 us)
      const v16 total = splat16(totals[h]);
      for (int c = 0; c < C; c += 2)
        store_pairs(out_rows[h] + c * kLanes, out[h][c] / total, out[h][c + 1] / total);
    } else {
      float widened[D];
      for (int c = 0; c < C; ++c) store16(widened + c * kLanes, out[h][c]);
      for (int64_t d = 0; d < D; ++d)
        out_rows[h][d] = from_float<QueryT>(widened[lane_of(d, D)] / totals[h]);
    }
  }
}

// Item k is (token, group of kv_per_item KV heads from kv0), the items taken from both ends in
// turn. How many KV heads an item holds changes which thread computes a head, never how.
struct Item {
  int64_t token, kv0, length;
  const int32_t* table;  // the token's row of the block tables
};

static inline Item item_at(const FixedOrderArgs& a, int64_t k) {
  const int64_t groups = a.num_kv_heads / a.kv_per_item;
  const int64_t num_items = a.num_tokens * groups;
  const int64_t item = k % 2 == 0 ? k / 2 : num_items - 1 - k / 2;
  const int64_t token = item / groups;
  return {token, item % groups * a.kv_per_item, a.token_lens[token],
          a.block_tables + a.token_rows[token] * a.table_stride};
}

// Item k's context asked for in `calls` calls of issue(), from its first key row (caches of
// `elem`-byte values)
static inline Ahead ahead_for(const FixedOrderArgs& a, int64_t k, int64_t calls, int64_t elem) {
  const Item it = item_at(a, k);
  return Ahead{static_cast<const char*>(a.key_cache), static_cast<const char*>(a.value_cache),
               it.table, it.length, a.block_size, a.slot_stride * elem, 0,
               (2 * it.length + calls - 1) / calls};
}

// For item k of [begin, end) that computes in `calls` calls of issue(): its successor's context,
// k + 1 or after the last item `next` (none where next is -1 or items hold one KV head each)
template <typename CacheT>
static inline Ahead ahead_of(const FixedOrderArgs& a, int64_t k, int64_t end, int64_t next,
                             int64_t calls) {
  const int64_t after = k + 1 < end ? k + 1 : next;
  if (a.kv_per_item != a.num_kv_heads || after < 0) return Ahead{};
  return ahead_for(a, after, calls, static_cast<int64_t>(sizeof(CacheT)));
}

// Items [begin, end) of 64-dim heads through attend_heads64
template <typename QueryT, typename CacheT>
static void register_items(const FixedOrderArgs& a, int64_t begin, int64_t end, int64_t next) {
  constexpr int64_t D = 64;
  const int64_t G = a.num_heads / a.num_kv_heads, nkv = a.kv_per_item;
  const auto* query = static_cast<const QueryT*>(a.query);
  const auto* keys = static_cast<const CacheT*>(a.key_cache);
  const auto* values = static_cast<const CacheT*>(a.value_cache);
  auto* result = static_cast<QueryT*>(a.out);
  std::vector<float> weights;
  for (int64_t k = begin; k < end; ++k) {
    const Item it = item_at(a, k);
    weights.resize(3 * it.length);
    // issue() twice a block in each of the item's passes
    const int64_t passes = nkv * ((G + 2) / 3);
    Ahead ahead =
        ahead_of<CacheT>(a, k, end, next, passes * 2 * ((it.length + kBlock - 1) / kBlock));
    for (int64_t kv = it.kv0; kv < it.kv0 + nkv; ++kv)
      for (int64_t h0 = 0; h0 < G; h0 += 3) {  // query heads kv * G + h0 ..., 3 at a time
        const QueryT* query_rows[3];
        QueryT* out_rows[3];
        const int64_t count = std::min<int64_t>(3, G - h0);
        for (int64_t h = 0; h < count; ++h) {
          query_rows[h] = query + it.token * a.query_stride + (kv * G + h0 + h) * D;
          out_rows[h] = result + (it.token * a.num_heads + kv * G + h0 + h) * D;
        }
        // the item's first pass touches its every KV head's rows (a slot's heads are
        // contiguous; unless the step loaded them before: touched_before); the later passes
        // find them in the L2 cache
        const int64_t touched = kv == it.kv0 && h0 == 0 && !touched_before(a) ? nkv : 0;
        auto* attend = count == 3   ? attend_heads64<3, QueryT, CacheT>
                       : count == 2 ? attend_heads64<2, QueryT, CacheT>
                                    : attend_heads64<1, QueryT, CacheT>;
        attend(a, keys, values, it.table, it.length, kv, touched, query_rows, out_rows,
               weights.data(), &ahead);
      }
  }
}

// Items [begin, end) of any head size: a block of rows widened into a buffer at a time
template <typename QueryT, typename CacheT>
static void buffer_items(const FixedOrderArgs& a, int64_t begin, int64_t end, int64_t next) {
  const int64_t G = a.num_heads / a.num_kv_heads, D = a.head_dim, nkv = a.kv_per_item;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  const int64_t heads = nkv * G;  // an item's query heads
  std::vector<float> queries(heads * Dp, 0.0f), block(kBlock * nkv * Dp, 0.0f);
  std::vector<float> out(heads * Dp), totals(heads), weights;
  const auto* query = static_cast<const QueryT*>(a.query);
  const auto* keys = static_cast<const CacheT*>(a.key_cache);
  const auto* values = static_cast<const CacheT*>(a.value_cache);
  auto* result = static_cast<QueryT*>(a.out);
  const int64_t stride = nkv * Dp;  // from a position's row of a head to the next position's
  for (int64_t k = begin; k < end; ++k) {
    const Item it = item_at(a, k);
    const int64_t token = it.token, kv0 = it.kv0, length = it.length;
    const int32_t* table = it.table;
    // head h of the item is query head kv0 * G + h, of KV head kv0 + h / G
    for (int64_t h = 0; h < heads; ++h) {
      const QueryT* q = query + token * a.query_stride + (kv0 * G + h) * D;
      for (int64_t d = 0; d < D; ++d) queries[h * Dp + lane_of(d, D)] = to_float(q[d]);
    }
    weights.resize(heads * length);
    Ahead ahead = ahead_of<CacheT>(a, k, end, next, 2 * ((length + kBlock - 1) / kBlock));
    // scores, a block of positions' keys widened at once (the next block's rows touched first)
    for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, length - p0);
      ahead.issue();
      if (!touched_before(a)) {  // the next block's keys, or after the last the first values
        if (p0 + n < length)
          touch_block(keys, a, table, kv0, nkv, p0 + n, std::min<int64_t>(kBlock, length - p0 - n));
        else
          touch_block(values, a, table, kv0, nkv, 0, std::min<int64_t>(kBlock, length));
      }
      widen_block(keys, a, table, kv0, nkv, p0, n, Dp, block.data());
      for (int64_t h = 0; h < heads; ++h) {
        const float* q = queries.data() + h * Dp;
        const float* keys_of_head = block.data() + (h / G) * Dp;
        // 16 positions' sums, 4 at a time; rows past n hold an earlier block's keys (or zeros)
        // and their lanes are dropped
        v16 acc[kBlock];
        for (int64_t i = 0; i < kBlock; i += 4) {
          const float* k = keys_of_head + i * stride;
          v16 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
          for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) {
            const v16 qd = load16(q + d0);
            acc0 = fma16(qd, load16(k + d0), acc0);
            acc1 = fma16(qd, load16(k + stride + d0), acc1);
            acc2 = fma16(qd, load16(k + 2 * stride + d0), acc2);
            acc3 = fma16(qd, load16(k + 3 * stride + d0), acc3);
          }
          acc[i] = acc0, acc[i + 1] = acc1, acc[i + 2] = acc2, acc[i + 3] = acc3;
        }
        store_scores(weights.data() + h * length + p0, lane_trees16(acc) * a.scale, n);
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      totals[h] = exponentiate(weights.data() + h * length, length);
    // out += weight * value, one position after another; a block of positions' values is
    // widened once and each accumulator stays in a register across the block
    std::fill(out.begin(), out.end(), 0.0f);
    for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, length - p0);
      ahead.issue();
      if (p0 + n < length && !touched_before(a))
        touch_block(values, a, table, kv0, nkv, p0 + n, std::min<int64_t>(kBlock, length - p0 - n));
      widen_block(values, a, table, kv0, nkv, p0, n, Dp, block.data());
      for (int64_t h = 0; h < heads; ++h) {
        const float* w = weights.data() + h * length + p0;
        const float* values_of_head = block.data() + (h / G) * Dp;
        float* o = out.data() + h * Dp;
        int64_t d0 = 0;
        for (; d0 + 4 * kLanes <= Dp; d0 += 4 * kLanes)
          add_weighted<4>(o + d0, values_of_head + d0, w, n, stride);
        switch ((Dp - d0) / kLanes) {
          case 3:
            add_weighted<3>(o + d0, values_of_head + d0, w, n, stride);
            break;
          case 2:
            add_weighted<2>(o + d0, values_of_head + d0, w, n, stride);
            break;
          case 1:
            add_weighted<1>(o + d0, values_of_head + d0, w, n, stride);
            break;
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      QueryT* o = result + (token * a.num_heads + kv0 * G + h) * D;
      for (int64_t d = 0; d < D; ++d)
        o[d] = from_float<QueryT>(out[h * Dp + lane_of(d, D)] / totals[h]);
    }
  }
}

template <typename QueryT, typename CacheT>
static void fixed_order_items(const FixedOrderArgs& a, int64_t begin, int64_t end,
                              int64_t next) {
  constexpr bool widened_by_f16c = std::is_same_v<CacheT, Fp16> || std::is_same_v<CacheT, Fp8>;
  if (a.head_dim == 64 && (SF_F16C || !widened_by_f16c))
    register_items<QueryT, CacheT>(a, begin, end, next);
  else
    buffer_items<QueryT, CacheT>(a, begin, end, next);
}

static void fixed_order_run(const FixedOrderArgs& a, int64_t begin, int64_t end, int64_t next) {
  switch (a.kinds) {
#define SF_CASE(Q, C, QT, CT)                            \
  case (Q) * splitfuse_fixed_order::kCacheKinds + (C): \
    return fixed_order_items<QT, CT>(a, begin, end, next);
    SF_CASE(0, 0, float, float)
    SF_CASE(0, 1, float, Bf16)
    SF_CASE(0, 2, float, Fp16)
    SF_CASE(0, 3, float, Fp8)
    SF_CASE(1, 0, Bf16, float)
    SF_CASE(1, 1, Bf16, Bf16)
    SF_CASE(1, 2, Bf16, Fp16)
    SF_CASE(1, 3, Bf16, Fp8)
    SF_CASE(2, 0, Fp16, float)
    SF_CASE(2, 1, Fp16, Bf16)
    SF_CASE(2, 2, Fp16, Fp16)
    SF_CASE(2, 3, Fp16, Fp8)
#undef SF_CASE
  }
}
