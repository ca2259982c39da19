// quantized_int8.cpp's products on AVX2 (with or without AVX-VNNI): packed 4-bit weights times rows of x
// rounded to int8. Each row's 4 consecutive weights are made one dword (a chunk's two 32-byte halves, whose
// words are 2 weights of each of the 16 rows, interleaved), so that x is broadcast 4 bytes at a time:
// VPMADDUBSW makes 32 products an instruction, summed in int16 (VPDPBUSD's int32 with AVX-VNNI). The
// interleave leaves rows 0-3 and 8-11 in one register, 4-7 and 12-15 in the other ("a" and "b"); d and m are
// read in the same order, and results leave it at the end (store_in_order).
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

// Chunk c's operands (top of this file), as ByteDots takes them: low nibbles (weights 8c .. 8c + 3 of each
// row) a and b, then high nibbles (8c + 4 .. 8c + 7) a and b.
template <Layout L>
inline void dword_operands(const uint8_t* chunk, __m256i* operand) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  const __m256i low0 = int8_codes<L>(_mm256_and_si256(half0, nibble));
  const __m256i low1 = int8_codes<L>(_mm256_and_si256(half1, nibble));
  const __m256i high0 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half0, 4), nibble));
  const __m256i high1 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half1, 4), nibble));
  operand[0] = _mm256_unpacklo_epi16(low0, low1), operand[1] = _mm256_unpackhi_epi16(low0, low1);
  operand[2] = _mm256_unpacklo_epi16(high0, high1), operand[3] = _mm256_unpackhi_epi16(high0, high1);
}

// One row's products over a scale block, codes (4 bytes of a row a dword) times x (4 bytes broadcast):
// VPDPBUSD adds each dword's 4 products straight into int32 where AVX-VNNI has it; otherwise VPMADDUBSW's
// pair sums add up in int16 (16 products a lane: 16 x 15 x 127 < 32767) and widen once a block, VPMADDWD
// against ones.
// Signed codes (MXFP4) give their magnitudes to the codes' operand and their signs to x's (VPSIGNB).
template <Layout L>
struct ByteDots {
  __m256i sum = _mm256_setzero_si256();
  void add(__m256i codes0, __m256i x0, __m256i codes1, __m256i x1) {
#if defined(__AVXVNNI__)
    if constexpr (Traits<L>::kCodeTable) {
      x0 = _mm256_sign_epi8(x0, codes0), x1 = _mm256_sign_epi8(x1, codes1);
      codes0 = _mm256_abs_epi8(codes0), codes1 = _mm256_abs_epi8(codes1);
    }
    sum = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(sum, codes0, x0), codes1, x1);
#else
    sum = _mm256_add_epi16(sum, _mm256_add_epi16(pair_products<L>(codes0, x0), pair_products<L>(codes1, x1)));
#endif
  }
  __m256i int32() const {
#if defined(__AVXVNNI__)
    return sum;
#else
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
  }
};

// A row's dots over chunk c: x's 8 bytes there, broadcast 4 at a time, against the chunk's operands.
template <Layout L>
inline void add_chunk(ByteDots<L>* dots, const __m256i* operand, const int8_t* x) {
  int32_t first, second;
  std::memcpy(&first, x, 4);
  std::memcpy(&second, x + 4, 4);
  const __m256i x_low = _mm256_set1_epi32(first), x_high = _mm256_set1_epi32(second);
  dots[0].add(operand[0], x_low, operand[2], x_high);
  dots[1].add(operand[1], x_low, operand[3], x_high);
}

// y (a and b, rows of 16 in the order above) = m sum(x_b) + (dot d dx + y): the same operations in the same order
// on every path, so that a row's result is bitwise the same at any row count.
inline void scale_into(__m256 y[2], __m256i dot_a, __m256i dot_b, const __m256* d, const __m256* m, float dx_scalar,
                       float sum_x_scalar) {
  const __m256 dx = _mm256_set1_ps(dx_scalar), sum_x = _mm256_set1_ps(sum_x_scalar);
  y[0] = _mm256_fmadd_ps(m[0], sum_x, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_a), _mm256_mul_ps(d[0], dx), y[0]));
  y[1] = _mm256_fmadd_ps(m[1], sum_x, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_b), _mm256_mul_ps(d[1], dx), y[1]));
}

// d and m of group G's block s in the a and b order.
template <Layout L>
inline void ab_scales(const PackedMatrix& w, int64_t G, int64_t s, __m256* d, __m256* m) {
  alignas(32) float ds[kGroup], ms[kGroup];
  int8_block_scales<L>(w, G, s, ds, ms);
  d[0] = _mm256_loadu2_m128(ds + 8, ds), d[1] = _mm256_loadu2_m128(ds + 12, ds + 4);
  m[0] = _mm256_loadu2_m128(ms + 8, ms), m[1] = _mm256_loadu2_m128(ms + 12, ms + 4);
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
  const int64_t K = w.K, num_blocks = K / kBlock;
  const uint8_t* codes = w.codes + G * w.group_bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = codes + s * Traits<L>::kChunks * kChunkBytes;
    ByteDots<L> dots[R][2];
    for (int c = 0; c < 4; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      __m256i operand[4];
      dword_operands<L>(block + c * kChunkBytes, operand);
      const int8_t* x = xq.codes.data() + s * kBlock + 8 * c;
      for (int r = 0; r < R; ++r) add_chunk<L>(dots[r], operand, x + (first_row + r) * K);
    }
    __m256 d[2], m[2];
    ab_scales<L>(w, G, s, d, m);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r) * num_blocks + s;
      scale_into(acc[r], dots[r][0].int32(), dots[r][1].int32(), d, m, xq.scales[i], xq.sums[i]);
    }
  }
  for (int r = 0; r < R; ++r) store_in_order(out + (first_row + r) * out_stride, acc[r][0], acc[r][1]);
}

using GroupFewRows = void (*)(const PackedMatrix&, int64_t, const Int8Rows&, int64_t, float*, int64_t);

template <Layout L>
GroupFewRows group_few_rows_for(int64_t rows) {
  return with_row_count<kFewRowsPass>(rows, [](auto R) -> GroupFewRows { return group_few_rows<L, R.value>; });
}

// Many rows without AVX-VNNI: each scale block's codes are unpacked once into the operands above (512 bytes,
// in L1) for a tile of x's rows (kRowTile), which then take them R rows a pass, their int16 sums in registers and their
// fp32 results in `acc` (rows of 16 in the a and b order). Before, each 4-row pass unpacked the block again
// and broadcast x 2 bytes at a time, its sums spilled (a 64-row decode step's matmuls ran at 145-180 GFLOP/s
// on AMD family 25, AVX2).
constexpr int kBlockPassRows = 4;  // 8 int16 sums, a chunk's 4 operands and x's 2 broadcasts: 14 registers

// acc (rows of 16 in the a and b order) += block s's products with x's rows first_row .. first_row + rows, R a pass.
template <Layout L, int R>
void block_passes(const __m256i* operands, const __m256* d, const __m256* m, const Int8Rows& xq, int64_t first_row,
                  int64_t rows, int64_t K, int64_t s, float* acc) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    ByteDots<L> dots[R][2];
    // Not unrolled: GCC unrolled the 4 chunks by itself and hoisted all 64 products ahead of their sums,
    // spilling them (the kernel ran no faster than the one it replaced).
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      const int8_t* x = xq.codes.data() + (first_row + r0) * K + s * kBlock + 8 * c;
      for (int r = 0; r < R; ++r) add_chunk<L>(dots[r], operands + 4 * c, x + r * K);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r0 + r) * num_blocks + s;
      float* y = acc + (r0 + r) * kGroup;
      __m256 ab[2] = {_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8)};
      scale_into(ab, dots[r][0].int32(), dots[r][1].int32(), d, m, xq.scales[i], xq.sums[i]);
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
  const int64_t K = w.K, num_blocks = K / kBlock, whole = rows / kBlockPassRows * kBlockPassRows;
  alignas(32) float acc[kRowTile * kGroup];
  std::fill_n(acc, rows * kGroup, 0.0f);
  alignas(32) __m256i operands[16];
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * Traits<L>::kChunks * kChunkBytes;
    for (int c = 0; c < 4; ++c) dword_operands<L>(block + c * kChunkBytes, operands + 4 * c);
    __m256 d[2], m[2];
    ab_scales<L>(w, G, s, d, m);
    block_passes<L, kBlockPassRows>(operands, d, m, xq, first_row, whole, K, s, acc);
    if (whole < rows) {
      with_row_count<kBlockPassRows - 1>(rows - whole, [&](auto R) {
        block_passes<L, R.value>(operands, d, m, xq, first_row + whole, rows - whole, K, s, acc + whole * kGroup);
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
  static_assert(Traits<L>::kCodeBits == 4 && (Traits<L>::kOffsets || Traits<L>::kCodeTable) &&
                Traits<L>::kScaleWeights == kBlock);
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
