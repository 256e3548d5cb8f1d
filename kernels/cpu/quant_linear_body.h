// The body of the 8-bit weight-only quantized product, compiled once per instruction set: the
// including file wraps it in `#pragma GCC target` and a namespace of its own, and defines SF_LANES
// (floats per vector), SF_ROW_TILE (rows of x per micro-kernel call), the vector types vfloat and
// vint (SF_LANES floats / int32s), lane_sum (the sum of a vfloat's lanes), halves_to_floats (n
// float16s as floats) and load_s8 (SF_LANES bytes widened to a vint: a plain vector conversion of
// bytes compiles to scalar code). The rest is GCC vector extensions, so one source becomes AVX-512,
// AVX2 or SSE2 code.

static inline vfloat load(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

// Row n of an 8-bit weight as floats: out[k] = scale[k / G] * q[k].
static void dequantize_row_8bit(const int8_t* qrow, const float* scales, int64_t K,
                                int64_t group_size, float* out) {
  for (int64_t g = 0; g < K / group_size; ++g) {
    const vfloat scale = scales[g] - (vfloat){};
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += SF_LANES) {
      store(out + k, __builtin_convertvector(load_s8(qrow + k), vfloat) * scale);
    }
  }
}

// out[r, t] = sum_k x[r, k] * w[t, k] for ROWS rows of x and COLS rows of w (w: COLS x K floats).
template <int ROWS, int COLS>
static void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                         int64_t ldo) {
  vfloat acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = (vfloat){};
  for (int64_t k = 0; k < K; k += SF_LANES) {
    vfloat wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = load(w + c * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const vfloat xv = load(x + r * ldx + k);
      for (int c = 0; c < COLS; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) out[r * ldo + c] = lane_sum(acc[r][c]);
}

// One row of x (a single decoding stream, an LM head on one row): the weight is dequantized in
// registers and multiplied at once, COLS output columns interleaved so that the sums do not wait
// on one another. x [K]; scales as floats, COLS x num_groups.
template <int COLS>
static void gemv_8bit(const float* x, const int8_t* qrows, int64_t K, int64_t group_size,
                      const float* scales, float* out) {
  // sum over groups of scale * (q . x): the scale multiplies a group's dot product once
  const int64_t num_groups = K / group_size;
  vfloat acc[COLS];
  for (int c = 0; c < COLS; ++c) acc[c] = (vfloat){};
  for (int64_t g = 0; g < num_groups; ++g) {
    vfloat dot[COLS][2];
    for (int c = 0; c < COLS; ++c) dot[c][0] = dot[c][1] = (vfloat){};
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 2 * SF_LANES) {
      // 8 tiles ahead: one stream per column defeats the hardware prefetcher (an int8 LM head
      // 49152 x 576, one thread: 5.2 -> 1.9 ms). Into the L2 cache, not the L1 (locality 2):
      // the L1's few outstanding misses limited the stream on an AMD EPYC (the same LM head,
      // cold caches, one thread: 3.6 -> 2.0 ms; two: 1.8 -> 1.0-1.3 ms).
      for (int c = 0; c < COLS; ++c) __builtin_prefetch(qrows + (8 * COLS + c) * K + k, 0, 2);
      for (int half = 0; half < 2; ++half) {
        const vfloat xv = load(x + k + half * SF_LANES);
        for (int c = 0; c < COLS; ++c) {
          const vint q = load_s8(qrows + c * K + k + half * SF_LANES);
          dot[c][half] += __builtin_convertvector(q, vfloat) * xv;
        }
      }
    }
    for (int c = 0; c < COLS; ++c)
      acc[c] += (dot[c][0] + dot[c][1]) * (scales[c * num_groups + g] - (vfloat){});
  }
  for (int c = 0; c < COLS; ++c) out[c] = lane_sum(acc[c]);
}

template <int COLS>
static void all_rows(const float* x, int64_t M, int64_t K, const float* w, float* out,
                     int64_t ldo) {
  int64_t r = 0;
  for (; r + SF_ROW_TILE <= M; r += SF_ROW_TILE)
    micro_kernel<SF_ROW_TILE, COLS>(x + r * K, K, w, K, out + r * ldo, ldo);
  switch (M - r) {  // the remainder, fewer than SF_ROW_TILE rows
#if SF_ROW_TILE > 3
    case 3: micro_kernel<3, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
#endif
#if SF_ROW_TILE > 2
    case 2: micro_kernel<2, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
#endif
    case 1: micro_kernel<1, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
    default: break;
  }
}

constexpr int kColTile = 4;  // weight rows dequantized together and multiplied as one tile

// Output columns [col_begin, col_end) of out [M, N] = x [M, K] @ dequantized(weight)^T, using
// `buffer` (kColTile * (K + K / group_size) floats) for the dequantized rows and their scales.
// scales are float16 bits, [N, K / group_size].
static void quant_linear_columns(const float* x, int64_t M, int64_t K, int64_t N,
                                 const int8_t* qweight, const uint16_t* scales, int64_t group_size,
                                 int64_t col_begin, int64_t col_end, float* buffer, float* out) {
  const int64_t num_groups = K / group_size;
  float* col_scales = buffer + kColTile * K;  // kColTile x num_groups
  for (int64_t n = col_begin; n < col_end; n += kColTile) {
    const int cols = static_cast<int>(col_end - n < kColTile ? col_end - n : kColTile);
    for (int c = 0; c < cols; ++c)
      halves_to_floats(scales + (n + c) * num_groups, num_groups, col_scales + c * num_groups);
    if (M == 1) {
      const int8_t* q = qweight + n * K;
      switch (cols) {
        case 4: gemv_8bit<4>(x, q, K, group_size, col_scales, out + n); break;
        case 3: gemv_8bit<3>(x, q, K, group_size, col_scales, out + n); break;
        case 2: gemv_8bit<2>(x, q, K, group_size, col_scales, out + n); break;
        default: gemv_8bit<1>(x, q, K, group_size, col_scales, out + n); break;
      }
      continue;
    }
    for (int c = 0; c < cols; ++c)
      dequantize_row_8bit(qweight + (n + c) * K, col_scales + c * num_groups, K, group_size,
                          buffer + c * K);
    switch (cols) {
      case 4: all_rows<4>(x, M, K, buffer, out + n, N); break;
      case 3: all_rows<3>(x, M, K, buffer, out + n, N); break;
      case 2: all_rows<2>(x, M, K, buffer, out + n, N); break;
      default: all_rows<1>(x, M, K, buffer, out + n, N); break;
    }
  }
}
