// y = x @ W.T, W in 4-, 5-, 6- or 8-bit codes with a scale (and offset) per block of 32 or 16 weights: the
// exact weights of GGUF's Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, k-quant (Q4_K/Q5_K/Q6_K) and MXFP4 files (quantized.h lists
// the layouts; MXFP4's nibbles are looked up in an int8 table as they are widened), read at 0.53-1.06 bytes
// a weight, as in the file, against bf16's 2. Every row count goes through the integer dot products here
// (VPDPWSSD on AVX-512-VNNI, VPMADDWD plus adds on AVX2, plain loops in the portable build), or through
// quantized_int8.cpp's where x is rounded to int8: batch-1 decode reads every weight once per token, so bytes
// and these instructions are its cost; many rows run in passes over each group's codes while they are in L1.
// A row's result is computed the same way whatever the row count (quantized per row and block, summed in
// the same order), so a request's numbers never depend on what shares its step: the batch-invariance rule
// (docs/architecture.md). Dequantized fp32/bf16 tiles for many rows measured up to ~20% faster on 8-bit and
// 6-bit codes at 256 rows, but computed rows differently from a decode's few.
//
// Weights come packed by serval/runner/quantization.py in groups of 16 output rows, so one 512-bit register
// holds 2 consecutive weights of each of the 16 rows as int16 and VPDPWSSD yields 16 row sums at once (on
// AVX2, two 256-bit registers of 8 rows each):
//   codes  4-bit: (N/16, K/32, 4, 64) uint8: chunk c unpacks (low nibbles, then high ones; each 32-byte half
//          widened to int16) into the operands of weight pairs 4c, 4c+1, 4c+2, 4c+3 of the block;
//          5- and 6-bit: (N/16, K/32, 5 or 6, 64) uint8: the same nibble chunks, each nibble joined with its
//          high bits from the scale block's last chunk (quantized.h) before it is widened;
//          8-bit: (N/16, K/32, 8, 64) int8: chunk c widens into the operands of pairs 2c and 2c+1;
//          operand word 2r + e holds row r's weight 2p + e of pair p;
//   scales, offsets, super_scales: d and m of each row's scale block, stored as quantized.h's layout says.
// Each scale block's integer dot product is scaled once: y += d dx dot(q, xq) + m sum(x_b).
// x is quantized per block of 32 to int16 with scale max|x| / 32767: its rounding (2^-15 of the block's
// largest value) is far below bf16's (2^-8 of each value), so these products are closer to fp32 than the
// bf16 path's. (int8 activations, as llama.cpp uses, cost half the instructions; quantized_int8.cpp serves
// every row count with them by default where it has the layout (has_int8_rows), outliers kept exact; these
// products serve the other layouts and `--batch-activations float32`.) The offset term uses the sum of the block's
// rounded x, so that the rounding meets the file's weights, not d q alone (quantized.h).
#include "quantized.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

constexpr int64_t kMaxRows = kFewRows;  // rows of x per pass: their accumulators stay in registers

using Int16Rows = QuantizedRows<int16_t>;

#if defined(__AVX512VNNI__)
inline __m512i broadcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i widen_u8(__m256i bytes) { return _mm512_cvtepu8_epi16(bytes); }
inline __m512i widen_s8(__m256i bytes) { return _mm512_cvtepi8_epi16(bytes); }
template <bool kSigned>
inline __m512i widen(__m256i bytes) { return kSigned ? widen_s8(bytes) : widen_u8(bytes); }

// 16 output rows (packed group G) for R rows of x. R is a template argument so that the accumulators are
// registers; with few rows each row's block sum is split over independent chains, since one VPDPWSSD chain
// waits ~5 cycles per instruction: with a single chain a batch-1 decode ran at a quarter of the unit's rate,
// far below memory speed.
template <Layout L, int R>
void group_rows(const PackedMatrix& w, int64_t G, const Int16Rows& xq, int64_t first_row, float* out,
                int64_t out_stride) {
  using T = Traits<L>;
  const int64_t K = w.K, num_scale_blocks = K / T::kScaleWeights, x_blocks = K / kBlock;
  constexpr int kOperands = T::kNibbles ? 4 : 2;  // per chunk
  constexpr int kCodeChunks = T::kNibbles ? T::kNibbleChunks : T::kChunks;  // the high-bit chunk aside
  constexpr int kChains = R == 1 ? 4 : (R == 2 ? 2 : 1);
  const uint8_t* codes = w.codes + G * w.group_bytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_scale_blocks; ++s) {
    const uint8_t* block = codes + s * T::kChunks * kChunkBytes;
    __m512i dots[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kChains; ++h) dots[r][h] = _mm512_setzero_si512();
    __m512i high = _mm512_setzero_si512();
    if constexpr (T::kHighBits > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(block + kCodeChunks * kChunkBytes + kPrefetchBytes), _MM_HINT_T0);
      high = _mm512_loadu_si512(block + kCodeChunks * kChunkBytes);
    }
    for (int c = 0; c < kCodeChunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(block + c * kChunkBytes + kPrefetchBytes), _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(block + c * kChunkBytes);
      __m512i operand[kOperands];
      if constexpr (T::kNibbles) {
        const __m512i lo = nibble_codes<L>(packed, high, c, 0), hi = nibble_codes<L>(packed, high, c, 1);
        operand[0] = widen<T::kSignedCodes>(_mm512_castsi512_si256(lo));
        operand[1] = widen<T::kSignedCodes>(_mm512_extracti64x4_epi64(lo, 1));
        operand[2] = widen<T::kSignedCodes>(_mm512_castsi512_si256(hi));
        operand[3] = widen<T::kSignedCodes>(_mm512_extracti64x4_epi64(hi, 1));
      } else {
        operand[0] = widen_s8(_mm512_castsi512_si256(packed));
        operand[1] = widen_s8(_mm512_extracti64x4_epi64(packed, 1));
      }
      for (int r = 0; r < R; ++r) {
        const int16_t* xr = xq.codes.data() + (first_row + r) * K + s * T::kScaleWeights + 2 * kOperands * c;
        for (int o = 0; o < kOperands; ++o) {
          __m512i& chain = dots[r][(c * kOperands + o) % kChains];
          chain = _mm512_dpwssd_epi32(chain, operand[o], broadcast_pair(xr + 2 * o));
        }
      }
    }
    alignas(64) float d[kGroup], m[kGroup];
    block_scales<L>(w, G, s, d, m);
    for (int r = 0; r < R; ++r) {
      __m512i dot = dots[r][0];
      for (int h = 1; h < kChains; ++h) dot = _mm512_add_epi32(dot, dots[r][h]);
      const int64_t i = (first_row + r) * x_blocks + s * T::kScaleWeights / kBlock;
      const __m512 dx = _mm512_mul_ps(_mm512_load_ps(d), _mm512_set1_ps(xq.scales[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, acc[r]);
      if constexpr (T::kOffsets) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(m), _mm512_set1_ps(xq.sums[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}
#elif defined(__AVX2__)
// acc + a * b, int16 lanes multiplied and summed in pairs into int32: one VPDPWSSD where AVX-VNNI has it,
// VPMADDWD and an add on plain AVX2.
inline __m256i add_pair_products(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  simd::add_in_place_epi32(acc, _mm256_madd_epi16(a, b));
  return acc;
#endif
}

// A scale block's high-bit chunk (its last; zeros for layouts without high bits), its two 32-byte halves.
template <Layout L>
[[gnu::always_inline]] inline void high_bit_halves(const uint8_t* block, __m256i* high0, __m256i* high1) {
  *high0 = *high1 = _mm256_setzero_si256();
  if constexpr (Traits<L>::kHighBits > 0) {
    const uint8_t* high = block + Traits<L>::kNibbleChunks * kChunkBytes;
    *high0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
    *high1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 32));
  }
}

// Chunk c's operands (bytes): a 64-byte chunk's 32-byte half h holds rows 0-7 in its low 16 bytes and rows 8-15
// in its high 16 bytes (2 weights each); nibble layouts' low nibbles, then high ones, joined with their high
// bits (high0 and high1: the scale block's last chunk).
template <Layout L>
[[gnu::always_inline]] inline void chunk_operands(const uint8_t* block, __m256i high0, __m256i high1, int c,
                                                  __m256i* operand) {
  const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes));
  const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + 32));
  if constexpr (Traits<L>::kNibbles) {
    operand[0] = nibble_codes<L>(half0, high0, c, 0);
    operand[1] = nibble_codes<L>(half1, high1, c, 0);
    operand[2] = nibble_codes<L>(half0, high0, c, 1);
    operand[3] = nibble_codes<L>(half1, high1, c, 1);
  } else {
    operand[0] = half0;
    operand[1] = half1;
  }
}

// An operand's bytes widened to int16: rows 0-7 (rows0) and 8-15 (rows1), 2 weights each.
template <Layout L>
[[gnu::always_inline]] inline void widen_pair(__m256i operand, __m256i* rows0, __m256i* rows1) {
  const __m128i low = _mm256_castsi256_si128(operand), high = _mm256_extracti128_si256(operand, 1);
  *rows0 = Traits<L>::kSignedCodes ? _mm256_cvtepi8_epi16(low) : _mm256_cvtepu8_epi16(low);
  *rows1 = Traits<L>::kSignedCodes ? _mm256_cvtepi8_epi16(high) : _mm256_cvtepu8_epi16(high);
}

// acc (a row's 16 results: rows 0-7, 8-15) += d dx dot + m sum(x_b): a scale block's sums, the same operations
// whatever the row count.
template <Layout L>
[[gnu::always_inline]] inline void scale_into(__m256 acc[2], const __m256i dot[2], const float* d, const float* m,
                                              float dx, float sum_x) {
  for (int h = 0; h < 2; ++h) {
    const __m256 d_dx = _mm256_mul_ps(_mm256_load_ps(d + 8 * h), _mm256_set1_ps(dx));
    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), d_dx, acc[h]);
    if constexpr (Traits<L>::kOffsets)  // + m sum(x_b)
      acc[h] = _mm256_fmadd_ps(_mm256_load_ps(m + 8 * h), _mm256_set1_ps(sum_x), acc[h]);
  }
}

// AVX2 has no VPDPWSSD (AVX-VNNI's 256-bit one aside, add_pair_products): VPMADDWD multiplies the same int16
// operands pairwise into int32 (8 per register) and a separate add accumulates them. One packed group is two
// 8-row halves here (chunk_operands).
template <Layout L, int R>
void group_rows(const PackedMatrix& w, int64_t G, const Int16Rows& xq, int64_t first_row, float* out,
                int64_t out_stride) {
  using T = Traits<L>;
  const int64_t K = w.K, num_scale_blocks = K / T::kScaleWeights, x_blocks = K / kBlock;
  constexpr int kOperands = T::kNibbles ? 4 : 2;  // weight pairs per chunk
  constexpr int kCodeChunks = T::kNibbles ? T::kNibbleChunks : T::kChunks;  // the high-bit chunk aside
  const uint8_t* codes = w.codes + G * w.group_bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < num_scale_blocks; ++s) {
    const uint8_t* block = codes + s * T::kChunks * kChunkBytes;
    __m256i dots[R][2];
    for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
    if constexpr (T::kHighBits > 0) simd::prefetch(block + kCodeChunks * kChunkBytes + kPrefetchBytes);
    __m256i high0, high1;
    high_bit_halves<L>(block, &high0, &high1);
    // Not unrolled: GCC's full unroll of the block kept all 16 products live and spilled them to the stack.
#pragma GCC unroll 1
    for (int c = 0; c < kCodeChunks; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      __m256i operand[kOperands];  // 32 bytes of (row, element) pairs each: pair kOperands * c + o
      chunk_operands<L>(block, high0, high1, c, operand);
      for (int o = 0; o < kOperands; ++o) {
        __m256i rows0, rows1;
        widen_pair<L>(operand[o], &rows0, &rows1);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xq.codes.data() + (first_row + r) * K + s * T::kScaleWeights + 2 * (kOperands * c + o), 4);
          const __m256i x = _mm256_set1_epi32(pair);
          dots[r][0] = add_pair_products(dots[r][0], rows0, x);
          dots[r][1] = add_pair_products(dots[r][1], rows1, x);
        }
      }
    }
    alignas(32) float d[kGroup], m[kGroup];
    block_scales<L>(w, G, s, d, m);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r) * x_blocks + s * T::kScaleWeights / kBlock;
      scale_into<L>(acc[r], dots[r], d, m, xq.scales[i], xq.sums[i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * out_stride, acc[r][0]);
    _mm256_storeu_ps(out + r * out_stride + 8, acc[r][1]);
  }
}

// Many rows over short rows of weights: each scale block's codes are widened once (int16 pairs, in L1) for a
// tile of x's rows, which take them 4 rows a pass, their 8 sums in registers beside a pair's 2 operands and x,
// their fp32 results in `acc`. group_rows widens them again for every pass of kMaxRows, whose 16 sums do not fit
// AVX2's 16 registers beside those and spill. On AMD family 25 (Q8_0, one thread, against group_rows): K 1024
// and 1536 0.85-0.90x the time at 64 rows, K 576 and 1536 0.80-0.91x at 16 (the default model's LM head, 49152
// x 576: 0.79-0.84x at 64). Over longer rows a tile's x no longer stays near (32 rows of K 8192 in int16: 512
// KB, the whole L2): K 2048 took 0.85x the time at 64 rows but 1.16x at 16, K 8192 0.85-1.15x at 16 to 64.
constexpr int64_t kTileRows = 32;
constexpr int kTilePassRows = 4;
constexpr int64_t kTileMaxK = 1536;

// acc (rows of 16) += scale block s's products with x's rows first_row .. first_row + rows, R a pass: the block's
// pairs (rows 0-7 and 8-15 of weight pair p) widened, d and m its scales.
template <Layout L, int R>
void tile_passes(const __m256i (*pairs)[2], const float* d, const float* m, const Int16Rows& xq, int64_t first_row,
                 int64_t rows, int64_t K, int64_t s, float* acc) {
  using T = Traits<L>;
  constexpr int kPairs = static_cast<int>(T::kScaleWeights / 2);
  const int64_t x_blocks = K / kBlock;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int16_t* x = xq.codes.data() + (first_row + r0) * K + s * T::kScaleWeights;
    __m256i dots[R][2];
    for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
    for (int p = 0; p < kPairs; ++p) {
      const __m256i rows0 = _mm256_load_si256(&pairs[p][0]), rows1 = _mm256_load_si256(&pairs[p][1]);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + 2 * p, 4);
        const __m256i xr = _mm256_set1_epi32(pair);
        dots[r][0] = add_pair_products(dots[r][0], rows0, xr);
        dots[r][1] = add_pair_products(dots[r][1], rows1, xr);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r0 + r) * x_blocks + s * T::kScaleWeights / kBlock;
      float* y = acc + (r0 + r) * kGroup;
      __m256 sums[2] = {_mm256_load_ps(y), _mm256_load_ps(y + 8)};
      scale_into<L>(sums, dots[r], d, m, xq.scales[i], xq.sums[i]);
      _mm256_store_ps(y, sums[0]);
      _mm256_store_ps(y + 8, sums[1]);
    }
  }
}

// out (group G's 16 columns of rows first_row .. first_row + rows; rows <= kTileRows) = its products with x.
template <Layout L>
void group_tile(const PackedMatrix& w, int64_t G, const Int16Rows& xq, int64_t first_row, int64_t rows, float* out,
                int64_t out_stride) {
  using T = Traits<L>;
  constexpr int kOperands = T::kNibbles ? 4 : 2;
  constexpr int kCodeChunks = T::kNibbles ? T::kNibbleChunks : T::kChunks;
  const int64_t K = w.K, num_scale_blocks = K / T::kScaleWeights;
  const int64_t whole = rows / kTilePassRows * kTilePassRows;
  alignas(32) float acc[kTileRows * kGroup];
  std::fill_n(acc, rows * kGroup, 0.0f);
  alignas(32) __m256i pairs[T::kScaleWeights / 2][2];
  for (int64_t s = 0; s < num_scale_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * T::kChunks * kChunkBytes;
    __m256i high0, high1;
    high_bit_halves<L>(block, &high0, &high1);
    for (int c = 0; c < kCodeChunks; ++c) {
      __m256i operand[kOperands];
      chunk_operands<L>(block, high0, high1, c, operand);
      for (int o = 0; o < kOperands; ++o) {
        __m256i* pair = pairs[kOperands * c + o];
        widen_pair<L>(operand[o], &pair[0], &pair[1]);
      }
    }
    alignas(32) float d[kGroup], m[kGroup];
    block_scales<L>(w, G, s, d, m);
    tile_passes<L, kTilePassRows>(pairs, d, m, xq, first_row, whole, K, s, acc);
    if (whole < rows)
      with_row_count<kTilePassRows - 1>(rows - whole, [&](auto R) {
        tile_passes<L, R.value>(pairs, d, m, xq, first_row + whole, rows - whole, K, s, acc + whole * kGroup);
      });
  }
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_storeu_ps(out + (first_row + r) * out_stride, _mm256_load_ps(acc + r * kGroup));
    _mm256_storeu_ps(out + (first_row + r) * out_stride + 8, _mm256_load_ps(acc + r * kGroup + 8));
  }
}
#else
// Portable: the same integer sums, one block unpacked at a time (the compiler vectorizes over the 16 rows).
template <Layout L, int R>
void group_rows(const PackedMatrix& w, int64_t G, const Int16Rows& xq, int64_t first_row, float* out,
                int64_t out_stride) {
  using T = Traits<L>;
  const int64_t K = w.K, num_scale_blocks = K / T::kScaleWeights, x_blocks = K / kBlock;
  const uint8_t* codes = w.codes + G * w.group_bytes;
  float acc[R][kGroup] = {};
  for (int64_t s = 0; s < num_scale_blocks; ++s) {
    int16_t q[T::kScaleWeights][kGroup];
    unpack_block<L>(codes + s * T::kChunks * kChunkBytes, q);
    float d[kGroup], m[kGroup];
    block_scales<L>(w, G, s, d, m);
    for (int r = 0; r < R; ++r) {
      const int16_t* x = xq.codes.data() + (first_row + r) * K + s * T::kScaleWeights;
      const int64_t i = (first_row + r) * x_blocks + s * T::kScaleWeights / kBlock;
      int32_t dot[kGroup] = {};
      for (int k = 0; k < T::kScaleWeights; ++k)
        for (int n = 0; n < kGroup; ++n) dot[n] += static_cast<int32_t>(q[k][n]) * x[k];
      for (int n = 0; n < kGroup; ++n) {
        acc[r][n] += static_cast<float>(dot[n]) * (d[n] * xq.scales[i]);
        if constexpr (T::kOffsets) acc[r][n] += m[n] * xq.sums[i];
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * out_stride, acc[r], sizeof(acc[r]));
}
#endif

using GroupRows = void (*)(const PackedMatrix&, int64_t, const Int16Rows&, int64_t, float*, int64_t);

template <Layout L>
GroupRows group_rows_for(int64_t rows) {
  return with_row_count<kMaxRows>(rows, [](auto R) -> GroupRows { return group_rows<L, R.value>; });
}

GroupRows group_rows_for(Layout layout, int64_t rows) {
  return with_layout(layout, [&](auto L) { return group_rows_for<decltype(L)::value>(rows); });
}

// Rows of int16 x (quantized per block) through group_rows, in passes of kMaxRows over each group, whose codes
// stay in L1 between passes; on AVX2, many rows over short rows of weights in tiles (group_tile).
void run_integer_rows(const Int16Rows& xq, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                  int64_t out_stride) {
  // About 16 chunks a call: enough to balance, few enough that handing them out costs nothing.
  const int64_t grain = num_groups / 16;
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  if (M > kMaxRows && w.K <= kTileMaxK) {
    with_layout(layout, [&](auto L) {
      parallel_chunks(num_groups, grain, [&](int64_t begin, int64_t end) {
        for (int64_t G = begin; G < end; ++G)
          for (int64_t r = 0; r < M; r += kTileRows)
            group_tile<decltype(L)::value>(w, G, xq, r, std::min(kTileRows, M - r), out + G * kGroup, out_stride);
      });
    });
    return;
  }
#endif
  const GroupRows run_full = group_rows_for(layout, kMaxRows), run_rest = group_rows_for(layout, M % kMaxRows);
  parallel_chunks(num_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t G = begin; G < end; ++G)
      for (int64_t r = 0; r < M; r += kMaxRows)
        (M - r >= kMaxRows ? run_full : run_rest)(w, G, xq, r, out + r * out_stride + G * kGroup, out_stride);
  });
}

}  // namespace

namespace serval_kernels::quantized {

// out = x @ w.T through the int16 products above (x rounded to int16 per block), for fp32 or bf16 x.
void matmul_int16_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                       int64_t out_stride) {
  run_integer_rows(quantize_rows<int16_t>(x, M, w.K), M, w, layout, num_groups, out, out_stride);
}

void matmul_int16_rows(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                       float* out, int64_t out_stride) {
  run_integer_rows(quantize_rows<int16_t>(x, M, w.K), M, w, layout, num_groups, out, out_stride);
}

void matmul_packed_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                        int64_t out_stride, bool int8_batch_activations) {
  if (int8_batch_activations && has_int8_rows(layout) && M >= int8_rows_from()) {
    matmul_int8_rows(x, M, w, layout, num_groups, out, out_stride);
  } else {
    run_integer_rows(quantize_rows<int16_t>(x, M, w.K), M, w, layout, num_groups, out, out_stride);
  }
}

}  // namespace serval_kernels::quantized
