// quantized_int8.cpp's products on AVX2 (with or without AVX-VNNI): packed 4-, 5- and 6-bit weights times
// rows of x rounded to int8. Each row's 4 consecutive weights are made one dword (a chunk's two 32-byte
// halves, whose words are 2 weights of each of the 16 rows, interleaved), so that x is broadcast 4 bytes at a
// time: VPMADDUBSW makes 32 products an instruction, summed in int16 (VPDPBUSD's int32 with AVX-VNNI). The
// interleave leaves rows 0-3 and 8-11 in one register, 4-7 and 12-15 in the other ("a" and "b"); d and m are
// read in the same order, and results leave it at the end (store_in_order).
// Q6_K's scale blocks are 16 weights (2 nibble chunks and their high bits), so x's block of 32 spans two
// (ScaleBlocks): each one's sums widen weighted by its sub-block scale, and the two are scaled once. The 5-bit
// layouts' int16 sums widen twice a block too (kUnbiased5Bit), unweighted.
// Decode steps' few rows stream each group's codes in passes whose sums stay in registers (group_few_rows);
// many rows share each block's codes unpacked once (group_block_passes). Both compute a row's numbers with the
// same operations in the same order, so a row's result is bitwise the same at any row count (batch invariance).
#pragma once
#include "group_output.h"
#include "int8_codes.h"
#include "int8_split.h"

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
namespace serval_kernels::quantized::avx2 {

using Int8Rows = QuantizedRows<int8_t>;

// How x's blocks of 32 meet a layout's scale blocks: one scale block each (4- and 5-bit layouts) or two (Q6_K's
// 16); and in how many spans of chunks VPMADDUBSW's int16 sums add up before they widen to int32 (ByteDots):
// one (4-bit codes: 16 products a lane) or two (Q6_K's scale blocks; the 5-bit codes' 8 products a lane).
template <Layout L>
struct ScaleBlocks {
  static constexpr int kPerXBlock = static_cast<int>(kBlock / Traits<L>::kScaleWeights);
  static constexpr int kCodeChunks = 4 / kPerXBlock;  // chunks of 8 weights a row in a scale block
  static constexpr int64_t kBytes = Traits<L>::kChunks * kChunkBytes;  // a scale block's, high bits included
  static constexpr int kSpans = L == Layout::kQ6K || kUnbiased5Bit<L> ? 2 : 1;
  static constexpr int kSpanChunks = 4 / kSpans;
  // span b's scale block in the x block, and its first chunk there
  static constexpr int scale_block(int b) { return b * kPerXBlock / kSpans; }
  static constexpr int first_chunk(int b) { return b * kSpanChunks % kCodeChunks; }
};

// A chunk's operands (top of this file): VPMADDUBSW's unsigned ones (low nibbles a and b: weights 8c .. 8c + 3 of
// each row; then high nibbles a and b: 8c + 4 .. 8c + 7) and, for signed codes (kSignedOperand), the codes
// whose signs x takes (VPSIGNB), the operands then being their magnitudes: made once a chunk, not once a row.
struct ChunkOperands {
  __m256i codes[4];
  __m256i signs[4];
};

// Chunk c's operands. block: the chunk's scale block, whose last chunk holds Q6_K's high bits. Inlined always:
// called apart, Q6_K's operands went through the stack and a lone row's pass waited on them (3.3x the int16
// path's time on AMD family 25).
template <Layout L>
[[gnu::always_inline]] inline void dword_operands(const uint8_t* block, int c, ChunkOperands* operands) {
  const uint8_t* chunk = block + c * kChunkBytes;
  const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  __m256i low0, low1, high0, high1;
  if constexpr (Traits<L>::kHighBits > 0) {  // Q6_K's codes less their bias (quantized.h); 5-bit ones as stored
    // Q5_1's nibble_codes subtract no bias: the three 5-bit layouts store their codes alike
    constexpr Layout kCodes = kUnbiased5Bit<L> ? Layout::kQ5 : L;
    const uint8_t* bits = block + Traits<L>::kNibbleChunks * kChunkBytes;
    const __m256i bits0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
    const __m256i bits1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 32));
    low0 = nibble_codes<kCodes>(half0, bits0, c, 0), low1 = nibble_codes<kCodes>(half1, bits1, c, 0);
    high0 = nibble_codes<kCodes>(half0, bits0, c, 1), high1 = nibble_codes<kCodes>(half1, bits1, c, 1);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    low0 = int8_codes<L>(_mm256_and_si256(half0, nibble));
    low1 = int8_codes<L>(_mm256_and_si256(half1, nibble));
    high0 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half0, 4), nibble));
    high1 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half1, 4), nibble));
  }
  __m256i* codes = operands->codes;
  codes[0] = _mm256_unpacklo_epi16(low0, low1), codes[1] = _mm256_unpackhi_epi16(low0, low1);
  codes[2] = _mm256_unpacklo_epi16(high0, high1), codes[3] = _mm256_unpackhi_epi16(high0, high1);
  if constexpr (kSignedOperand<L>) {
    for (int o = 0; o < 4; ++o) operands->signs[o] = codes[o], codes[o] = _mm256_abs_epi8(codes[o]);
  }
}

// One row's products over a span of chunks (ScaleBlocks), codes (4 bytes of a row a dword) times x (4 bytes
// broadcast, with the codes' signs where they have them): VPDPBUSD adds each dword's 4 products straight into
// int32 where AVX-VNNI has it; otherwise VPMADDUBSW's pair sums add up in int16 (16 products a lane: 16 x 15 x
// 127 < 32767; Q6_K's 8 x 32 x 127, 5-bit codes' 8 x 31 x 127) and widen once a span, VPMADDWD against ones or
// against Q6_K's sub-block scales.
struct ByteDots {
  __m256i sum = _mm256_setzero_si256();
  void add(__m256i codes0, __m256i x0, __m256i codes1, __m256i x1) {
#if defined(__AVXVNNI__)
    sum = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sum, codes0, x0), codes1, x1);
#else
    sum = _mm256_add_epi16(sum, _mm256_add_epi16(_mm256_maddubs_epi16(codes0, x0), _mm256_maddubs_epi16(codes1, x1)));
#endif
  }
  __m256i int32() const {
#if defined(__AVXVNNI__)
    return sum;
#else
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
  }
  // The sums in int32, each row's times its Q6_K sub-block scale (sub_block_weights).
  __m256i int32(__m256i weight) const {
#if defined(__AVXVNNI__)
    return _mm256_mullo_epi32(sum, weight);
#else
    return _mm256_madd_epi16(sum, weight);
#endif
  }
};

// A row's dots over chunk c: x's 8 bytes there, broadcast 4 at a time, against the chunk's operands.
template <Layout L>
inline void add_chunk(ByteDots* dots, const ChunkOperands& operands, const int8_t* x) {
  int32_t first, second;
  std::memcpy(&first, x, 4);
  std::memcpy(&second, x + 4, 4);
  const __m256i x_low = _mm256_set1_epi32(first), x_high = _mm256_set1_epi32(second);
  const __m256i* codes = operands.codes;
  if constexpr (kSignedOperand<L>) {
    const __m256i* signs = operands.signs;
    dots[0].add(codes[0], _mm256_sign_epi8(x_low, signs[0]), codes[2], _mm256_sign_epi8(x_high, signs[2]));
    dots[1].add(codes[1], _mm256_sign_epi8(x_low, signs[1]), codes[3], _mm256_sign_epi8(x_high, signs[3]));
  } else {
    dots[0].add(codes[0], x_low, codes[2], x_high);
    dots[1].add(codes[1], x_low, codes[3], x_high);
  }
}

// What scales x block s's integer sums, in the a and b order: d and m. Q6_K's d = D sc changes every 16
// weights: each scale block's sums are weighted by its int8 sc as they widen (sub_block_weights) and the two
// added in int32 (|sc dot| <= 128 x 16 x 32 x 127 < 2^23 each: exact, and exactly converted), then scaled by
// the super-block's D once, its d here. m only where the layout has offsets (scale_into).
struct XBlockScales {
  __m256 d[2], m[2];
};

// A row's 16 values (row order) in the a and b order.
inline void ab_order(const float* v, __m256* ab) {
  ab[0] = _mm256_loadu2_m128(v + 8, v), ab[1] = _mm256_loadu2_m128(v + 12, v + 4);
}

template <Layout L>
[[gnu::always_inline]] inline XBlockScales x_block_scales(const PackedMatrix& w, int64_t G, int64_t s) {
  XBlockScales scales;
  alignas(32) float d[kGroup], m[kGroup];
  if constexpr (L == Layout::kQ6K) {
    const at::Half* super = w.super + (G * (w.K / kSuperWeights) + s * kBlock / kSuperWeights) * 2 * kGroup;
    for (int v = 0; v < kGroup; v += simd::kWidth) simd::store(d + v, simd::load(super + v));
  } else {
    int8_block_scales<L>(w, G, s, d, m);
  }
  ab_order(d, scales.d);
  if constexpr (kInt8Offsets<L>) ab_order(m, scales.m);
  return scales;
}

// Q6_K's sc of scale block b (of the matrix's K / 16), as ByteDots::int32 weighs a half's sums by it.
[[gnu::always_inline]] inline void sub_block_weights(const PackedMatrix& w, int64_t G, int64_t b, __m256i weight[2]) {
  const auto* sc = static_cast<const int8_t*>(w.scales) + (G * (w.K / Traits<Layout::kQ6K>::kScaleWeights) + b) * kGroup;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
#if defined(__AVXVNNI__)
  const __m256i rows0 = _mm256_cvtepi8_epi32(bytes), rows8 = _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8));
  weight[0] = _mm256_permute2x128_si256(rows0, rows8, 0x20);  // rows 0-3, 8-11
  weight[1] = _mm256_permute2x128_si256(rows0, rows8, 0x31);  // rows 4-7, 12-15
#else
  const __m256i rows = _mm256_cvtepi8_epi16(bytes);  // rows 0-7, then 8-15: sc twice a dword
  weight[0] = _mm256_unpacklo_epi16(rows, rows), weight[1] = _mm256_unpackhi_epi16(rows, rows);
#endif
}

// dot (a and b, int32) of an x block = its span b's sums widened, added to the earlier spans' (Q6_K's weighted
// by `weight`, their scale block's sc; the other layouts' take no weight).
template <Layout L, int R>
[[gnu::always_inline]] inline void widen_into(__m256i dot[R][2], const ByteDots dots[R][2], const __m256i weight[2],
                                              int b) {
  (void)weight;  // Q6_K's only
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m256i widened = L == Layout::kQ6K ? dots[r][h].int32(weight[h]) : dots[r][h].int32();
      dot[r][h] = b == 0 ? widened : _mm256_add_epi32(dot[r][h], widened);
    }
}

// y (a and b, rows of 16 in the order above) = m sum(x_b) + (dot d dx + y), without the m term where the layout
// has no offsets here (MXFP4 on AVX2, Q6_K; kInt8Offsets): the same operations in the same order on every path,
// so that a row's result is bitwise the same at any row count.
template <Layout L>
inline void scale_into(__m256 y[2], const __m256i dot[2], const XBlockScales& scales, float dx_scalar,
                       float sum_x_scalar) {
  const __m256 dx = _mm256_set1_ps(dx_scalar), sum_x = _mm256_set1_ps(sum_x_scalar);
  for (int h = 0; h < 2; ++h) {
    y[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), _mm256_mul_ps(scales.d[h], dx), y[h]);
    if constexpr (kInt8Offsets<L>) y[h] = _mm256_fmadd_ps(scales.m[h], sum_x, y[h]);
  }
}

// A row's a and b results back in row order at y.
inline void store_in_order(float* y, __m256 a, __m256 b) {
  _mm256_storeu2_m128(y + 8, y, a);
  _mm256_storeu2_m128(y + 12, y + 4, b);
}

// A decode step's few rows (up to kFewRows) on AVX2: the int16 path's VPMADDWD takes a widened operand and an
// add per 2 products (quantized_linear.cpp), which held a batch-1 decode on Zen 2 to 43-47% of the memory's read
// bandwidth; here VPMADDUBSW takes the packed nibbles as they are. Passes of up to 4 rows over each group, their
// accumulators in registers, the codes streamed from memory (prefetched) and re-read from L1 by later passes.
// With AVX-VNNI every row count takes these passes (matmul_impl).
constexpr int kFewRowsPass = 4;  // rows of x a pass: 4 accumulators and 4 int16 sums each beside the operands

template <Layout L, int R>
void group_few_rows(const PackedMatrix& w, int64_t G, const Int8Rows& xq, int64_t first_row, float* out,
                    int64_t out_stride) {
  using S = ScaleBlocks<L>;
  const int64_t K = w.K, num_blocks = K / kBlock;
  const uint8_t* codes = w.codes + G * w.group_bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    __m256i dot[R][2];
    for (int b = 0; b < S::kSpans; ++b) {
      const int sb = S::scale_block(b), first = S::first_chunk(b);
      const uint8_t* block = codes + (s * S::kPerXBlock + sb) * S::kBytes;
      if (Traits<L>::kHighBits > 0 && first == 0)  // the high bits' chunk, once a scale block
        simd::prefetch(block + Traits<L>::kNibbleChunks * kChunkBytes + kPrefetchBytes);
      ByteDots dots[R][2];
      for (int c = first; c < first + S::kSpanChunks; ++c) {
        simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
        ChunkOperands operands;
        dword_operands<L>(block, c, &operands);
        const int8_t* x = xq.codes.data() + s * kBlock + 8 * (sb * S::kCodeChunks + c);
        for (int r = 0; r < R; ++r) add_chunk<L>(dots[r], operands, x + (first_row + r) * K);
      }
      __m256i weight[2];
      if constexpr (L == Layout::kQ6K) sub_block_weights(w, G, s * S::kPerXBlock + sb, weight);
      widen_into<L, R>(dot, dots, weight, b);
    }
    const XBlockScales scales = x_block_scales<L>(w, G, s);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r) * num_blocks + s;
      scale_into<L>(acc[r], dot[r], scales, xq.scales[i], xq.sums[i]);
    }
  }
  for (int r = 0; r < R; ++r) store_in_order(out + (first_row + r) * out_stride, acc[r][0], acc[r][1]);
}

using GroupFewRows = void (*)(const PackedMatrix&, int64_t, const Int8Rows&, int64_t, float*, int64_t);

template <Layout L>
GroupFewRows group_few_rows_for(int64_t rows) {
  return with_row_count<kFewRowsPass>(rows, [](auto R) -> GroupFewRows { return group_few_rows<L, R.value>; });
}

// Many rows without AVX-VNNI: each x block's codes are unpacked once into the operands above (in L1) for a tile of
// x's rows (kRowTile), which then take them R rows a pass, their int16 sums in registers and their fp32 results
// in `acc` (rows of 16 in the a and b order). Before, each 4-row pass unpacked the block again and broadcast x
// 2 bytes at a time, its sums spilled (a 64-row decode step's matmuls ran at 145-180 GFLOP/s on AMD family 25,
// AVX2).
// 4: 8 int16 sums, a chunk's 4 operands and x's 2 broadcasts: 14 registers. Two spans a block (Q6_K, 5-bit) 2:
// beside those the first span's int32 sums (and Q6_K's signs) (AMD family 25, Q6_K at 64 rows: 2 rows 0.89x the
// time of 4, 3 rows 0.96x).
template <Layout L>
inline constexpr int kBlockPassRows = ScaleBlocks<L>::kSpans == 2 ? 2 : 4;

// acc (rows of 16 in the a and b order) += x block s's products with x's rows first_row .. first_row + rows, R a
// pass: the block's 4 chunks' operands (in x's order: operand c meets x's 8 values from 8c).
template <Layout L, int R>
void block_passes(const ChunkOperands* operands, const __m256i (*weights)[2], const XBlockScales& scales,
                  const Int8Rows& xq, int64_t first_row, int64_t rows, int64_t K, int64_t s, float* acc) {
  using S = ScaleBlocks<L>;
  const int64_t num_blocks = K / kBlock;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    __m256i dot[R][2];
    for (int b = 0; b < S::kSpans; ++b) {
      ByteDots dots[R][2];
      // Not unrolled: GCC unrolled the 4 chunks by itself and hoisted all 64 products ahead of their sums,
      // spilling them (the kernel ran no faster than the one it replaced).
#pragma GCC unroll 1
      for (int c = b * S::kSpanChunks; c < (b + 1) * S::kSpanChunks; ++c) {
        const int8_t* x = xq.codes.data() + (first_row + r0) * K + s * kBlock + 8 * c;
        for (int r = 0; r < R; ++r) add_chunk<L>(dots[r], operands[c], x + r * K);
      }
      widen_into<L, R>(dot, dots, weights[S::scale_block(b)], b);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r0 + r) * num_blocks + s;
      float* y = acc + (r0 + r) * kGroup;
      __m256 ab[2] = {_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8)};
      scale_into<L>(ab, dot[r], scales, xq.scales[i], xq.sums[i]);
      _mm256_storeu_ps(y, ab[0]);
      _mm256_storeu_ps(y + 8, ab[1]);
    }
  }
}

// Rows of x a tile: each block's operands are unpacked once a tile, and the tile's sums (2 KB) and x's rows stay
// in L1 while the group's blocks go by. Against all rows in one tile (AMD family 25, the default model's four
// shapes): 64 rows 0.86x the time of 64-row tiles, 512 rows 0.88x those and ~0.75x one tile; 16 rows no better.
constexpr int64_t kRowTile = 32;

// out (group G's 16 columns of rows first_row .. first_row + rows, rows out_stride apart; rows <= kRowTile) = its
// products with x.
template <Layout L>
void group_block_passes(const PackedMatrix& w, int64_t G, const Int8Rows& xq, int64_t first_row, int64_t rows,
                        float* out, int64_t out_stride) {
  using S = ScaleBlocks<L>;
  const int64_t K = w.K, num_blocks = K / kBlock, whole = rows / kBlockPassRows<L> * kBlockPassRows<L>;
  alignas(32) float acc[kRowTile * kGroup];
  std::fill_n(acc, rows * kGroup, 0.0f);
  ChunkOperands operands[4];
  __m256i weights[S::kPerXBlock][2];  // Q6_K's
  for (int64_t s = 0; s < num_blocks; ++s) {
    for (int b = 0; b < S::kPerXBlock; ++b) {
      const uint8_t* block = w.codes + G * w.group_bytes + (s * S::kPerXBlock + b) * S::kBytes;
      for (int c = 0; c < S::kCodeChunks; ++c) dword_operands<L>(block, c, &operands[b * S::kCodeChunks + c]);
      if constexpr (L == Layout::kQ6K) sub_block_weights(w, G, s * S::kPerXBlock + b, weights[b]);
    }
    const XBlockScales scales = x_block_scales<L>(w, G, s);
    block_passes<L, kBlockPassRows<L>>(operands, weights, scales, xq, first_row, whole, K, s, acc);
    if (whole < rows) {
      with_row_count<kBlockPassRows<L> - 1>(rows - whole, [&](auto R) {
        block_passes<L, R.value>(operands, weights, scales, xq, first_row + whole, rows - whole, K, s,
                                 acc + whole * kGroup);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* y = acc + r * kGroup;
    store_in_order(out + (first_row + r) * out_stride, _mm256_load_ps(y), _mm256_load_ps(y + 8));
  }
}

template <Layout L, typename In>
void matmul_impl(const In* x, int64_t M, const PackedMatrix& w, int64_t num_groups, float* out,
                 int64_t out_stride, GroupOutput to) {
  static_assert((Traits<L>::kCodeBits == 4 && (Traits<L>::kOffsets || Traits<L>::kCodeTable) &&
                 Traits<L>::kScaleWeights == kBlock) || kUnbiased5Bit<L> || L == Layout::kQ6K);
  const Int8Split split = split_for_int8(x, M, w.K);
  const Int8Rows& xq = split.rows;
#if defined(__AVXVNNI__)
  constexpr bool kAllRowsInPasses = true;  // VPDPBUSD's int32 sums: registers for every row's passes
#else
  constexpr bool kAllRowsInPasses = false;
#endif
  if (M <= kFewRows || kAllRowsInPasses) {  // passes over each group, whose codes stay in L1 between them
    const GroupFewRows full = group_few_rows_for<L>(kFewRowsPass), rest = group_few_rows_for<L>(M % kFewRowsPass);
    // A few rows' groups are quick and even: large guided shares. Many rows' are long: one at a time.
    const bool few = M <= kFewRows;
    run_groups(M, num_groups, out, out_stride, to, /*fine=*/!few, [&](int64_t G, float* y, int64_t stride) {
      for (int64_t r0 = 0; r0 < M; r0 += kFewRowsPass) (M - r0 >= kFewRowsPass ? full : rest)(w, G, xq, r0, y, stride);
      add_outlier_products<L>(w, G, split.outliers, y, stride);
    });
    return;
  }
  run_groups(M, num_groups, out, out_stride, to, /*fine=*/true, [&](int64_t G, float* y, int64_t stride) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
      group_block_passes<L>(w, G, xq, r0, std::min(kRowTile, M - r0), y, stride);
    add_outlier_products<L>(w, G, split.outliers, y, stride);
  });
}

}  // namespace serval_kernels::quantized::avx2
#endif
