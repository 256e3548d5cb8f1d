// The body of splitfuse_cpu::int4_linear, compiled once per instruction set: the including file
// wraps it in `#pragma GCC target` and a namespace of its own, and defines
//   SF_LANES        int32 (and float) lanes per vector
//   SF_ROW_TILE     rows of x per micro-kernel call when there are several
//   SF_COL_BLOCKS   column blocks per micro-kernel call when there are several rows
//   vint, vfloat    SF_LANES int32s / floats; vbyte: 4 * SF_LANES uint8s
//   SF_BYTE_DOT     1 where bytes of any value (0..255) multiply whole (VNNI's VPDPBUSD), 0
//                   where they multiply in pairs into int16 lanes (4-bit values only)
//   dot4(acc, w, x) (SF_BYTE_DOT 1) acc + per int32 lane the sum of its 4 bytes of w times the
//                   4 int8s of x
//   byte_pairs(w, x), pair_sums(p)   (SF_BYTE_DOT 0) per int16 lane the sum of its 2 bytes of w
//                   (0..15) times 2 int8s of x (VPMADDUBSW); per int32 lane the sum of its 2
//                   int16s (VPMADDWD)
//   load_halves(p)  SF_LANES float16s as floats
//   round_even(v)   v rounded to the nearest integer, ties to even (as the reference rounds)
//   SF_ROWS_TILE    (optional) a function template <BITS, ROWS> with `tile`'s arguments but the
//                   first, that multiplies tiles of 2 .. SF_ROW_TILE rows (one column block)
//                   in the body's place (int4_linear_avx2.h)
// The rest is GCC vector extensions, so one source becomes AVX-512 (with or without VNNI), AVX2
// or SSE2 code. The SF_ parameters are undefined at the end.
//
// 8-bit weights (PackedInt8: symmetric values q in -127..127 stored as the bytes u = q + 128)
// run the same way: sum_k u x = sum_k q x + 128 sum_k x, so a run adds
//   sum_u * (scale_w * d_x) + (-128 scale_w) * s_x
// the 4-bit form with the min -128 scale_w. Without SF_BYTE_DOT a byte multiplies as its two
// nibbles, sum_u = sum_low + 16 sum_high: the same int32 sums on every instruction set.

constexpr int kCols = 16;                   // output columns per packed block
constexpr int kVecs = kCols / SF_LANES;     // vectors per block
constexpr int kRun = 32;                    // x values per int8 block (one scale each)

static inline vbyte load_bytes(const uint8_t* p) {
  vbyte v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline vfloat load_floats(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline int32_t load_word(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

typedef int8_t vchar __attribute__((vector_size(SF_LANES)));           // SF_LANES int8s
typedef uint16_t vshort __attribute__((vector_size(2 * SF_LANES)));    // SF_LANES uint16s
typedef uint32_t vuint __attribute__((vector_size(4 * SF_LANES)));     // SF_LANES uint32s

static inline vfloat load_values(const float* p) { return load_floats(p); }

static inline vfloat load_values(const uint16_t* p) {  // bfloat16 bits: exact
  vshort halves;
  __builtin_memcpy(&halves, p, sizeof halves);
  const vuint bits = __builtin_convertvector(halves, vuint) << 16;
  vfloat v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

// The largest lane and the sum of the lanes, halving the vector (integers: any order gives the
// same result)
#if SF_LANES == 16
#define SF_FOLD(v, OP)                                                                       \
  v = OP(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, \
                                    7));                                                     \
  v = OP(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10,  \
                                    11));                                                    \
  v = OP(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12,  \
                                    13));                                                    \
  v = OP(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#elif SF_LANES == 8
#define SF_FOLD(v, OP)                                                   \
  v = OP(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));     \
  v = OP(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));     \
  v = OP(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))
#else
#define SF_FOLD(v, OP)                                       \
  v = OP(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));     \
  v = OP(v, __builtin_shufflevector(v, v, 1, 0, 3, 2))
#endif
static inline vint lanes_larger(vint a, vint b) { return a > b ? a : b; }
static inline vint lanes_added(vint a, vint b) { return a + b; }
static inline int32_t largest_lane(vint v) {
  SF_FOLD(v, lanes_larger);
  return v[0];
}
static inline int32_t lane_sum(vint v) {
  SF_FOLD(v, lanes_added);
  return v[0];
}
#undef SF_FOLD

// Rows [begin, end) of x [M, K] as int8 in runs of 32, the reference's arithmetic
// (engine/quantization.py, quantize_activations):
//   d = max|x| / 127,  q = round_even(x * (1 / d)),  s = d * sum(q)     (d = 0: q = 0)
template <typename T>
static void quantize_rows(const T* x, int64_t K, int64_t begin, int64_t end, int8_t* q, float* d,
                          float* s) {
  constexpr int kRunVecs = kRun / SF_LANES;
  const int64_t runs = K / kRun;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t run = 0; run < runs; ++run) {
      const T* in = x + r * K + run * kRun;
      vfloat values[kRunVecs];
      vint magnitude = (vint){};
      for (int j = 0; j < kRunVecs; ++j) {
        values[j] = load_values(in + j * SF_LANES);
        vint bits;
        __builtin_memcpy(&bits, &values[j], sizeof bits);
        bits &= 0x7fffffff;
        magnitude = bits > magnitude ? bits : magnitude;  // a float's order, as an integer
      }
      const int32_t largest_bits = largest_lane(magnitude);
      float largest;
      __builtin_memcpy(&largest, &largest_bits, sizeof largest);
      const float scale = largest / 127.0f;
      const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
      int8_t* out = q + r * K + run * kRun;
      vint total = (vint){};
      for (int j = 0; j < kRunVecs; ++j) {
        const vint rounded = round_even(values[j] * inverse);  // in -127 .. 127
        total += rounded;
        const vchar narrow = __builtin_convertvector(rounded, vchar);
        __builtin_memcpy(out + j * SF_LANES, &narrow, sizeof narrow);
      }
      d[r * runs + run] = scale;
      s[r * runs + run] = scale * static_cast<float>(lane_sum(total));
    }
  }
}

// A run's byte products add up in vrun lanes: int32 sums where bytes multiply whole (dot4);
// else int16 sums of pairs of products (byte_pairs), widened to int32 once a run (pair_sums)
// instead of once a step. A run adds at most 8 pairs of 4-bit values times int8s (-127..127) to
// a lane, 8 * 2 * 15 * 127 = 30,480 < 2^15: no int16 sum wraps, and the int32 sums are the same.
// (Held to AVX2, medians of 6 alternating processes: the default model's 4-bit layer products at
// 32 rows 1.15 -> 1.05 ms, its 8-bit LM head at one row 0.77 -> 0.70 ms.)
#if SF_BYTE_DOT
typedef vint vrun;
static inline vrun run_add(vrun acc, vbyte w, int32_t x) { return dot4(acc, w, x); }
static inline vint run_sum(vrun acc) { return acc; }
#else
typedef int16_t vrun __attribute__((vector_size(4 * SF_LANES)));
static inline vrun run_add(vrun acc, vbyte w, int32_t x) { return acc + byte_pairs(w, x); }
static inline vint run_sum(vrun acc) { return pair_sums(acc); }
#endif

// out [ROWS, CB * 16] (row stride ldo) = ROWS rows of int8 x times CB packed blocks of 16
// columns of BITS-bit weights. A 4-bit block is K / 8 steps of 64 bytes: step k8 holds, for
// each of the 16 columns, 4 bytes whose low nibbles are the column's values k8 * 8 + 0..3 and
// whose high nibbles are values k8 * 8 + 4..7, so one 64-byte load, a mask and a shift give two
// vectors that multiply 4 consecutive x values broadcast to every lane (dot4: VPDPBUSD with
// VNNI). An 8-bit block is K / 4 steps of 64 bytes: step k4 holds each column's values
// k4 * 4 + 0..3, one byte each. Per run of 32 x values, the int32 sums turn into floats once:
//   out += sum_q * (scale_w * d_x);  out += min_w * s_x     (8 bits: min_w = -128 scale_w)
// two fused multiply-adds into the accumulator: four vector instructions per row and column
// vector a run, where adding the two terms first took five (with AVX-512's tiles of 6 rows,
// int4_linear_avx512.h, the default model's 4-bit layer products at 32 rows, medians of 6
// alternating processes: 11.2 -> 10.6 ms with the weights in the caches, 12.6 -> 11.6 ms
// cycling through 30 layers).
// Each column's arithmetic is the same whatever ROWS and CB are: a row's result does not depend
// on the other rows of the call.
template <int BITS, int ROWS, int CB>
static void tile(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                 const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                 int64_t num_groups, int64_t group_size, float* out, int64_t ldo,
                 int64_t fetch_first, int64_t fetch_every) {
  constexpr int kValuesPerStep = BITS == 4 ? 8 : 4;   // of one column, in its 4 bytes of a step
  constexpr int kSteps = kRun / kValuesPerStep;       // 64-byte steps per run
  const int64_t block_bytes = K * 2 * BITS;           // 16 columns x K BITS-bit values
  const int64_t block_scales = num_groups * kCols;
  const int64_t runs = K / kRun;
  const int64_t runs_per_group = group_size / kRun;
  vfloat acc[ROWS][CB][kVecs];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CB; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = (vfloat){};
  // Each byte product adds to an int32 sum that the previous one wrote (VPDPBUSD: ~4 cycles
  // before the next may start); with fewer than 4 sums in flight the two halves of a step (4
  // bits: the low and the high nibbles; 8 bits: the even and the odd steps) add to sums of
  // their own, joined per run. Integer sums: the same result either way. 8-bit bytes that
  // dot4 cannot take whole add as their nibbles, to sums of their own too.
  constexpr bool kNibbles = BITS == 8 && !SF_BYTE_DOT;
  constexpr int kChains = kNibbles || ROWS * CB * kVecs < 4 ? 2 : 1;
  // the weight's group of each run, counted (a division per run cost ~8% of one row's product)
  int64_t group = 0, run_in_group = 0;
  int64_t fetch_at = fetch_first;  // the next step whose lines of the next blocks are asked for
  for (int64_t run = 0; run < runs; ++run) {
    vrun dot[ROWS][CB][kVecs][kChains];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < CB; ++c)
        for (int v = 0; v < kVecs; ++v)
          for (int h = 0; h < kChains; ++h) dot[r][c][v][h] = (vrun){};
    for (int step = 0; step < kSteps; ++step) {
      const int64_t k8 = run * kSteps + step;  // the step in the block
      // One or two rows wait on the weight's bytes, and the hardware prefetcher starts over
      // on every call's (and thread's) few kilobytes: the CB blocks after these (contiguous
      // with them) are asked for into the L2 cache, 64 bytes per block per step, so the next
      // tile's bytes arrive while this one multiplies (a prefetch past the weight's end never
      // faults). The default model's 120 products of one row, alternated in one process:
      // 5.39 -> 4.89 ms and 3.75 -> 3.49 ms (-7 to -9%); no number changes. Tiles of more
      // rows wait on them too where the weight comes from memory: tile fetch_first of the
      // fetch_every tiles that pass over these blocks asks for every fetch_every-th step's
      // lines, so the tiles share the next blocks' bytes evenly. The int4 default model's
      // steps, alternated in one engine (1.0 = before): 8 streams 0.846, 32 streams 0.962 (one
      // row: unchanged); one thread alone, weights from memory: 32 rows 0.88-0.93, 8 rows
      // 0.62-0.87 (the LM head's 8-bit product gains the most).
      if (ROWS <= 2 || k8 == fetch_at) {  // (one or two rows: every step)
        for (int c = 0; c < CB; ++c)
          __builtin_prefetch(packed + CB * block_bytes + (k8 * CB + c) * 64, 0, 2);
        fetch_at += fetch_every;
      }
      if constexpr (BITS == 4 || kNibbles) {
        vbyte low[CB][kVecs], high[CB][kVecs];
        for (int c = 0; c < CB; ++c)
          for (int v = 0; v < kVecs; ++v) {
            const vbyte w = load_bytes(packed + c * block_bytes + k8 * 64 + v * 4 * SF_LANES);
            low[c][v] = w & 15;
            high[c][v] = w >> 4;
          }
        for (int r = 0; r < ROWS; ++r) {
          // 4 bits: the high nibbles are the next 4 values; 8 bits: the same values' high halves
          const int32_t x_low = load_word(xq + r * K + k8 * kValuesPerStep);
          const int32_t x_high = BITS == 4 ? load_word(xq + r * K + k8 * 8 + 4) : x_low;
          for (int c = 0; c < CB; ++c)
            for (int v = 0; v < kVecs; ++v) {
              dot[r][c][v][0] = run_add(dot[r][c][v][0], low[c][v], x_low);
              dot[r][c][v][kChains - 1] = run_add(dot[r][c][v][kChains - 1], high[c][v], x_high);
            }
        }
      } else {  // 8-bit bytes whole
        const int chain = kChains == 2 ? (step & 1) : 0;
        vbyte w[CB][kVecs];
        for (int c = 0; c < CB; ++c)
          for (int v = 0; v < kVecs; ++v)
            w[c][v] = load_bytes(packed + c * block_bytes + k8 * 64 + v * 4 * SF_LANES);
        for (int r = 0; r < ROWS; ++r) {
          const int32_t x4 = load_word(xq + r * K + k8 * 4);
          for (int c = 0; c < CB; ++c)
            for (int v = 0; v < kVecs; ++v)
              dot[r][c][v][chain] = run_add(dot[r][c][v][chain], w[c][v], x4);
        }
      }
    }
    for (int c = 0; c < CB; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = c * block_scales + group * kCols + v * SF_LANES;
        const vfloat scale = load_halves(scales + at);
        const vfloat min = BITS == 4 ? load_halves(mins + at) : scale * -128.0f;
        for (int r = 0; r < ROWS; ++r) {
          // (the two sums of 4 bits join before they widen: 8 pairs at most)
          const vint sum = kNibbles       ? run_sum(dot[r][c][v][0]) +
                                                (run_sum(dot[r][c][v][kChains - 1]) << 4)
                           : kChains == 1 ? run_sum(dot[r][c][v][0])
                                          : run_sum(dot[r][c][v][0] + dot[r][c][v][kChains - 1]);
          acc[r][c][v] += __builtin_convertvector(sum, vfloat) * (scale * xd[r * runs + run]);
          acc[r][c][v] += min * xs[r * runs + run];
        }
      }
    if (++run_in_group == runs_per_group) {
      run_in_group = 0;
      ++group;
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CB; ++c)
      for (int v = 0; v < kVecs; ++v)
        __builtin_memcpy(out + r * ldo + c * kCols + v * SF_LANES, &acc[r][c][v], sizeof(vfloat));
}

template <int BITS, int ROWS>
static void tile_rows(int blocks, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                      const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                      int64_t num_groups, int64_t group_size, float* out, int64_t ldo,
                      int64_t fetch_first, int64_t fetch_every) {
#define SF_TILE(CB)                                                                          \
  tile<BITS, ROWS, CB>(xq, xd, xs, K, packed, scales, mins, num_groups, group_size, out, ldo, \
                       fetch_first, fetch_every)
  switch (blocks) {
#if SF_COL_BLOCKS > 3 || SF_ONE_ROW_BLOCKS > 3
    case 4: SF_TILE(4); break;
#endif
#if SF_COL_BLOCKS > 2 || SF_ONE_ROW_BLOCKS > 2
    case 3: SF_TILE(3); break;
#endif
    case 2: SF_TILE(2); break;
    default: SF_TILE(1); break;
  }
#undef SF_TILE
}

// Column blocks [block_begin, block_end) of out [M, N]: for each run of blocks (up to
// SF_COL_BLOCKS, or SF_ONE_ROW_BLOCKS for one row), every tile of rows in turn, so the blocks'
// bytes stay in the cache while the rows pass. `tile_out` holds 4 * 64 floats (int4_linear.h): a
// tile's result before the columns past N are cut off. out [M, N] float32. 8 bits: no mins.
static_assert(SF_ROW_TILE * SF_COL_BLOCKS * kCols <= 4 * 64 && SF_ONE_ROW_BLOCKS * kCols <= 4 * 64,
              "a tile's result must fit tile_out");
template <int BITS>
static void columns(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                    int64_t N, const uint8_t* packed, const uint16_t* scales,
                    const uint16_t* mins, int64_t group_size, int64_t block_begin,
                    int64_t block_end, float* tile_out, float* out) {
  const int64_t num_groups = K / group_size;
  const int64_t runs = K / kRun;
  const int max_blocks = M == 1 ? SF_ONE_ROW_BLOCKS : SF_COL_BLOCKS;
  for (int64_t nb = block_begin; nb < block_end; nb += max_blocks) {
    const int blocks = static_cast<int>(std::min<int64_t>(max_blocks, block_end - nb));
    const uint8_t* p = packed + nb * K * 2 * BITS;
    const uint16_t* sc = scales + nb * num_groups * kCols;
    const uint16_t* mn = BITS == 4 ? mins + nb * num_groups * kCols : nullptr;
    const int64_t col = nb * kCols;
    const int64_t width = std::min<int64_t>(blocks * kCols, N - col);
    const int64_t ldo = blocks * kCols;
    const int64_t tiles = (M + SF_ROW_TILE - 1) / SF_ROW_TILE;
    for (int64_t r0 = 0; r0 < M; r0 += SF_ROW_TILE) {
      const int rows = static_cast<int>(std::min<int64_t>(SF_ROW_TILE, M - r0));
      const int8_t* q = xq + r0 * K;
      const float* d = xd + r0 * runs;
      const float* s = xs + r0 * runs;
#ifdef SF_ROWS_TILE
#define SF_ROWS(R)                                                                             \
  if constexpr (R == 1)                                                                        \
    tile_rows<BITS, 1>(blocks, q, d, s, K, p, sc, mn, num_groups, group_size, tile_out, ldo,    \
                       r0 / SF_ROW_TILE, tiles);                                               \
  else                                                                                         \
    SF_ROWS_TILE<BITS, R>(q, d, s, K, p, sc, mn, num_groups, group_size, tile_out, ldo,         \
                          r0 / SF_ROW_TILE, tiles)
#else
#define SF_ROWS(R)                                                                             \
  tile_rows<BITS, R>(blocks, q, d, s, K, p, sc, mn, num_groups, group_size, tile_out, ldo,      \
                     r0 / SF_ROW_TILE, tiles)
#endif
      switch (rows) {
#if SF_ROW_TILE > 7
        case 8: SF_ROWS(8); break;
        case 7: SF_ROWS(7); break;
#endif
#if SF_ROW_TILE > 5
        case 6: SF_ROWS(6); break;
        case 5: SF_ROWS(5); break;
#endif
#if SF_ROW_TILE > 3
        case 4: SF_ROWS(4); break;
        case 3: SF_ROWS(3); break;
#endif
        case 2: SF_ROWS(2); break;
        default: SF_ROWS(1); break;
      }
#undef SF_ROWS
      for (int r = 0; r < rows; ++r)
        std::copy(tile_out + r * ldo, tile_out + r * ldo + width, out + (r0 + r) * N + col);
    }
  }
}

static void int4_columns(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                         int64_t N, const uint8_t* packed, const uint16_t* scales,
                         const uint16_t* mins, int64_t group_size, int64_t block_begin,
                         int64_t block_end, float* tile_out, float* out) {
  columns<4>(xq, xd, xs, M, K, N, packed, scales, mins, group_size, block_begin, block_end,
             tile_out, out);
}

static void int8_columns(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                         int64_t N, const uint8_t* packed, const uint16_t* scales,
                         int64_t group_size, int64_t block_begin, int64_t block_end,
                         float* tile_out, float* out) {
  columns<8>(xq, xd, xs, M, K, N, packed, scales, nullptr, group_size, block_begin, block_end,
             tile_out, out);
}

#undef SF_LANES
#undef SF_ROW_TILE
#undef SF_COL_BLOCKS
#undef SF_ONE_ROW_BLOCKS
#undef SF_BYTE_DOT
#undef SF_ROWS_TILE
