// The several-row tiles of splitfuse_cpu::int4_linear and int8_linear on AVX2 without VNNI,
// included in int4_linear.cpp's AVX2 namespace before int4_linear_body.h, whose `columns` calls
// rows_tile<BITS, ROWS> for tiles of 2 .. SF_ROW_TILE rows where SF_ROWS_TILE names it.
//
// AVX2 multiplies bytes in pairs (VPMADDUBSW: 32 byte products into 16 int16 sums), an add
// after each. The body's GCC vector code for these tiles (2 rows x 16 columns) ran ~2.5 billion
// VPMADDUBSW a second per core, where a core runs ~6 billion with their adds from registers:
// GCC reassociated each run's chain of int16 adds into a tree after all of the run's products,
// and the products waiting for it spilled to the stack (~20 vectors a run). Here a tile is
// ROWS rows times 8 columns (one vector; the block's two in turn), each row's sums pinned in a
// register after every step (an empty asm: the adds stay in order), so that the sums, the
// step's two vectors of nibbles and the x values they multiply fit the 16 registers:
//   4 bits: 8 rows, one int16 sum each (8 pairs of products a run at most, as in the body)
//   8 bits: 4 rows, two int16 sums each, the low and the high nibbles apart (8 pairs each)
// The arithmetic is the body's, lane for lane: the same int32 sums, and after them per run
//   acc = fma(float(sum), scale_w * d_x, acc);  acc = fma(min_w, s_x, acc)
// (8 bits: min_w = -128 scale_w)
// so a row's result has the same bits whatever tile multiplies it, and on every instruction set
// with FMA (tests/kernels/test_quant_linear.py, integer_dot_digest).
// One thread, held to AVX2, 32 rows (the default model's four products of a layer; its 8-bit
// LM head): 1.47 -> 1.20 ms and 18.2 -> 15.9 ms.

namespace avx2_rows {

constexpr int kRun = 32;  // x values per int8 run (one scale each)

static inline __m256i broadcast_word(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// out [ROWS, 16] (row stride ldo) = ROWS rows of int8 x times one packed block of 16 columns of
// BITS-bit weights (the layouts of int4_linear_body.h's `tile`); ROWS at most 8 (4 bits) or 4
// (8 bits). The next block is asked for as the body asks: tile fetch_first of the fetch_every
// tiles over this block asks for every fetch_every-th step's line (in the first vector's pass).
template <int BITS, int ROWS>
static void rows_chunk(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                       const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                       int64_t group_size, float* out, int64_t ldo, int64_t fetch_first,
                       int64_t fetch_every) {
  constexpr int kValuesPerStep = BITS == 4 ? 8 : 4;  // of one column, in its 4 bytes of a step
  constexpr int kSteps = kRun / kValuesPerStep;      // 64-byte steps per run
  constexpr int kSums = BITS == 4 ? 1 : 2;           // int16 sums per row
  const int64_t block_bytes = K * 2 * BITS;
  const int64_t runs = K / kRun;
  const int64_t runs_per_group = group_size / kRun;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sixteens = _mm256_set1_epi16(16);
  for (int v = 0; v < 2; ++v) {  // the block's two vectors of 8 columns
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    int64_t group = 0, run_in_group = 0;
    int64_t fetch_at = fetch_first;
    const uint8_t* w = packed + v * 32;
    for (int64_t run = 0; run < runs; ++run) {
      __m256i sum[ROWS][kSums];
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < kSums; ++h) sum[r][h] = _mm256_setzero_si256();
      _Pragma("GCC unroll 8") for (int step = 0; step < kSteps; ++step) {
        const int64_t k = run * kSteps + step;  // the step in the block
        if (v == 0 && k == fetch_at) {
          __builtin_prefetch(packed + block_bytes + k * 64, 0, 2);
          fetch_at += fetch_every;
        }
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64));
        const __m256i low = _mm256_and_si256(bytes, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        for (int r = 0; r < ROWS; ++r) {
          if constexpr (BITS == 4) {  // the high nibbles are the next 4 values
            const __m256i x_low = broadcast_word(xq + r * K + k * 8);
            const __m256i x_high = broadcast_word(xq + r * K + k * 8 + 4);
            sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(low, x_low));
            sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(high, x_high));
          } else {  // the same 4 values' low and high halves
            const __m256i x4 = broadcast_word(xq + r * K + k * 4);
            sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(low, x4));
            sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_maddubs_epi16(high, x4));
          }
          for (int h = 0; h < kSums; ++h) __asm__("" : "+x"(sum[r][h]));
        }
      }
      const int64_t at = group * 16 + v * 8;
      const __m256 scale =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at)));
      const __m256 min =
          BITS == 4
              ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at)))
              : _mm256_mul_ps(scale, _mm256_set1_ps(-128.0f));
      for (int r = 0; r < ROWS; ++r) {
        __m256i total = _mm256_madd_epi16(sum[r][0], ones);
        if constexpr (BITS == 8)
          total = _mm256_add_epi32(total, _mm256_madd_epi16(sum[r][1], sixteens));
        const __m256 scaled = _mm256_mul_ps(scale, _mm256_set1_ps(xd[r * runs + run]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scaled, acc[r]);
        acc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(xs[r * runs + run]), acc[r]);
      }
      if (++run_in_group == runs_per_group) {
        run_in_group = 0;
        ++group;
      }
    }
    for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * ldo + v * 8, acc[r]);
  }
}

// rows_chunk over ROWS rows (2 .. 8), in chunks whose sums fit the registers
template <int BITS, int ROWS>
static void rows_tile(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                      const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                      int64_t /*num_groups*/, int64_t group_size, float* out, int64_t ldo,
                      int64_t fetch_first, int64_t fetch_every) {
  constexpr int kChunk = BITS == 4 ? 8 : 4;  // rows whose int16 sums stay in registers
  if constexpr (ROWS <= kChunk) {
    rows_chunk<BITS, ROWS>(xq, xd, xs, K, packed, scales, mins, group_size, out, ldo, fetch_first,
                           fetch_every);
  } else {
    rows_chunk<BITS, kChunk>(xq, xd, xs, K, packed, scales, mins, group_size, out, ldo,
                             fetch_first, fetch_every);
    const int64_t runs = K / kRun;
    rows_tile<BITS, ROWS - kChunk>(xq + kChunk * K, xd + kChunk * runs, xs + kChunk * runs, K,
                                   packed, scales, mins, 0, group_size, out + kChunk * ldo, ldo,
                                   fetch_first, fetch_every);
  }
}

}  // namespace avx2_rows
