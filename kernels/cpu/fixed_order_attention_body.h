// The body of splitfuse_cpu::fixed_order_attention, included once per instruction set by
// fixed_order_attention.cpp. Every number a query's result depends on is computed by the same
// operations in the same order whatever else the call holds:
//   score(q, p)  = sum over head_dim in 16 fixed lanes (lane l adds dims l, l + 16, ... with
//                  fused multiply-adds), the lanes added as a fixed tree, times the scale
//   weight(q, p) = exp(score - max score): a polynomial of fused multiply-adds (exp_nonpositive)
//   sum          = the weights added one position after another
//   out(q)       = per dim, weight * value added one position after another, then / sum
// Only IEEE operations with one rounding each appear (fused multiply-adds spelled out: fma16 and
// std::fma), so a vectorized loop and its scalar remainder give the same bits, and so do the
// AVX-512, AVX2 and plain builds.

static inline float exp_nonpositive(float x) {
  // exp(x) for x <= 0, within ~1 ulp; 0 below -87.3 (where exp leaves the normal floats).
  const float clamped = x < -87.3f ? -87.3f : x;
  const float shifted = std::fma(clamped, 1.44269504088896341f, 12582912.0f);  // round to integer
  const float n = shifted - 12582912.0f;
  float r = std::fma(n, -0.693359375f, clamped);  // x - n ln 2, in two parts
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float r2 = r * r;
  const float y = std::fma(p, r2, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float power;
  __builtin_memcpy(&power, &bits, sizeof power);
  return x < -87.3f ? 0.0f : y * power;
}

static inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// The 16 lanes added as a fixed tree: halves, quarters, then ((0 + 2) + (1 + 3)).
// lane_tree of four accumulators at once, the same additions in the same pairs (so the same bits)
static inline v4 lane_trees(v16 a0, v16 a1, v16 a2, v16 a3) {
  const v16 e01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                          28, 29, 30, 31);
  const v16 e23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                          28, 29, 30, 31);
  // [quarters of a0, of a1, of a2, of a3]
  const v16 q = __builtin_shufflevector(e01, e23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                        25, 26, 27) +
                __builtin_shufflevector(e01, e23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                        29, 30, 31);
  // (quarter 0 + quarter 2), (quarter 1 + quarter 3) of each
  const v8 pairs = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) +
         __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);
}

static inline float lane_tree(v16 acc) {
  const v8 eighths = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 quarters = __builtin_shufflevector(eighths, eighths, 0, 1, 2, 3) +
                      __builtin_shufflevector(eighths, eighths, 4, 5, 6, 7);
  return (quarters[0] + quarters[2]) + (quarters[1] + quarters[3]);
}

template <typename CacheT>
static inline void load_row(const CacheT* in, int64_t n, float* out) {
  for (int64_t d = 0; d < n; ++d) out[d] = to_float(in[d]);
}

// bfloat16 -> float32 is a shift of the bits (exact), in a loop the compiler vectorizes
template <>
inline void load_row<Bf16>(const Bf16* in, int64_t n, float* out) {
  const auto* bits = reinterpret_cast<const uint16_t*>(in);
  auto* words = reinterpret_cast<uint32_alias*>(out);
  for (int64_t d = 0; d < n; ++d) words[d] = static_cast<uint32_t>(bits[d]) << 16;
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

// Items [begin, end): item k is (token, group of kv_per_item KV heads), the items taken from both
// ends in turn. How many KV heads an item holds changes which thread computes a head, never how.
template <typename QueryT, typename CacheT>
static void fixed_order_items(const FixedOrderArgs& a, int64_t begin, int64_t end) {
  const int64_t G = a.num_heads / a.num_kv_heads, D = a.head_dim, nkv = a.kv_per_item;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  const int64_t heads = nkv * G;  // an item's query heads
  std::vector<float> queries(heads * Dp, 0.0f), block(kBlock * nkv * Dp, 0.0f);
  std::vector<float> out(heads * Dp), totals(heads), weights;
  const auto* query = static_cast<const QueryT*>(a.query);
  const auto* keys = static_cast<const CacheT*>(a.key_cache);
  const auto* values = static_cast<const CacheT*>(a.value_cache);
  auto* result = static_cast<QueryT*>(a.out);
  const int64_t groups = a.num_kv_heads / nkv;
  const int64_t num_items = a.num_tokens * groups;
  const int64_t stride = nkv * Dp;  // from a position's row of a head to the next position's
  for (int64_t k = begin; k < end; ++k) {
    const int64_t item = k % 2 == 0 ? k / 2 : num_items - 1 - k / 2;
    const int64_t token = item / groups, kv0 = item % groups * nkv;
    const int64_t length = a.token_lens[token];
    const int32_t* table = a.block_tables + a.token_rows[token] * a.table_stride;
    // head h of the item is query head kv0 * G + h, of KV head kv0 + h / G
    for (int64_t h = 0; h < heads; ++h) {
      const QueryT* q = query + token * a.query_stride + (kv0 * G + h) * D;
      for (int64_t d = 0; d < D; ++d) queries[h * Dp + d] = to_float(q[d]);
    }
    weights.resize(heads * length);
    // scores, a block of positions' keys widened at once; four positions' lane trees at a time
    for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, length - p0);
      widen_block(keys, a, table, kv0, nkv, p0, n, Dp, block.data());
      for (int64_t h = 0; h < heads; ++h) {
        const float* q = queries.data() + h * Dp;
        const float* keys_of_head = block.data() + (h / G) * Dp;
        float* w = weights.data() + h * length + p0;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
          const float* k = keys_of_head + i * stride;
          v16 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
          for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) {
            const v16 qd = load16(q + d0);
            acc0 = fma16(qd, load16(k + d0), acc0);
            acc1 = fma16(qd, load16(k + stride + d0), acc1);
            acc2 = fma16(qd, load16(k + 2 * stride + d0), acc2);
            acc3 = fma16(qd, load16(k + 3 * stride + d0), acc3);
          }
          const v4 scores = lane_trees(acc0, acc1, acc2, acc3) * a.scale;
          __builtin_memcpy(w + i, &scores, sizeof scores);
        }
        for (; i < n; ++i) {
          const float* k = keys_of_head + i * stride;
          v16 acc = {};
          for (int64_t d0 = 0; d0 < Dp; d0 += kLanes)
            acc = fma16(load16(q + d0), load16(k + d0), acc);
          w[i] = lane_tree(acc) * a.scale;
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* w = weights.data() + h * length;
      float top = w[0];
      for (int64_t p = 1; p < length; ++p) top = w[p] > top ? w[p] : top;
      for (int64_t p = 0; p < length; ++p) w[p] = exp_nonpositive(w[p] - top);
      float total = 0.0f;
      for (int64_t p = 0; p < length; ++p) total = total + w[p];
      totals[h] = total;
    }
    // out += weight * value, one position after another; a block of positions' values is
    // widened once and each accumulator stays in a register across the block
    std::fill(out.begin(), out.end(), 0.0f);
    for (int64_t p0 = 0; p0 < length; p0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, length - p0);
      widen_block(values, a, table, kv0, nkv, p0, n, Dp, block.data());
      for (int64_t h = 0; h < heads; ++h) {
        const float* w = weights.data() + h * length + p0;
        const float* values_of_head = block.data() + (h / G) * Dp;
        float* o = out.data() + h * Dp;
        for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) {
          v16 acc = load16(o + d0);
          for (int64_t i = 0; i < n; ++i)
            acc = fma16(v16{} + w[i], load16(values_of_head + i * stride + d0), acc);
          store16(o + d0, acc);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      QueryT* o = result + (token * a.num_heads + kv0 * G + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = from_float<QueryT>(out[h * Dp + d] / totals[h]);
    }
  }
}

static void fixed_order_run(const FixedOrderArgs& a, int64_t begin, int64_t end) {
  switch (a.kinds) {
#define SF_CASE(Q, C, QT, CT) \
  case (Q) * 3 + (C):         \
    return fixed_order_items<QT, CT>(a, begin, end);
    SF_CASE(0, 0, float, float)
    SF_CASE(0, 1, float, Bf16)
    SF_CASE(0, 2, float, Fp16)
    SF_CASE(1, 0, Bf16, float)
    SF_CASE(1, 1, Bf16, Bf16)
    SF_CASE(1, 2, Bf16, Fp16)
    SF_CASE(2, 0, Fp16, float)
    SF_CASE(2, 1, Fp16, Bf16)
    SF_CASE(2, 2, Fp16, Fp16)
#undef SF_CASE
  }
}
