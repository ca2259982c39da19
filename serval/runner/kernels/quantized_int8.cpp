// Packed 4-bit weights times rows of x (prefill and decode steps, every row count) with int8 activations:
// unsigned 4-bit codes times signed 8-bit x. On AVX-512-VNNI, VPDPBUSD sums 4 products a row, 64 an
// instruction, against the int16 path's 32 (VPDPWSSD, quantized_linear.cpp); on AVX2, VPMADDUBSW makes 32
// products an instruction, twice what VPMADDWD does on int16 x (quantized_linear.cpp, which serves the other
// layouts and the portable build). This is llama.cpp's trade: x rounds to 1/127 of its block's
// largest value (int16's 1/32767 stays with `--batch-activations float32`), which the throughput pays for;
// docs/benchmarks.md measures it.
// The default (`--batch-activations int8`; `float32` keeps int16 x): with outliers exact (below) and the
// offset term summing the rounded x (quantized.h), its divergence from fp32 on the default model is below
// llama.cpp's on the same file (docs/benchmarks.md).
//
// For one packed group (16 output rows), scale block s (32 weights) and a few rows of x: each 32-byte half of
// a chunk, masked to its low or high nibbles, holds 2 consecutive weights of each of the 16 rows as byte
// pairs (quantized.h), so VPMADDUBSW against x's matching 2 bytes, broadcast, gives one int16 per row.
// 8 pairs sum in int16 without overflow (8 x 2 x 15 x 127 < 32767), so a block is two int16 sums a row,
// widened once: y += d dx dot(q, xq) + m sum(x_b) in fp32, sum(x_b) of the rounded x as on the few-row
// path (quantized.h says why).
//
// MXFP4's codes are signed table values v (-12..12, quantized.h), which the unsigned operand of VPMADDUBSW and
// VPDPBUSD cannot take as they are. With VPDPBUSD's int32 sums (AVX-512) the table is shifted to unsigned
// v + 12 and the offset m = -12 d takes the shift back, as Q4_0's m = -8 d does; VPMADDUBSW's int16 sums
// (AVX2) would overflow with codes up to 24 (16 x 24 x 127 > 32767), so there a code gives VPMADDUBSW its
// magnitude and x its sign (VPSIGNB), as ggml does, and m is 0. Either way the products are exactly v x.
#include "group_output.h"
#include "int8_split.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

#if defined(__AVX2__)
// The table MXFP4's nibbles are looked up in, as the products here take them (top of this file): v + 12 with
// VPDPBUSD's int32 sums, signed v with VPMADDUBSW's int16 ones.
#if defined(__AVX512VNNI__)
constexpr bool kTableShifted = true;
alignas(16) constexpr int8_t kInt8Table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#else
constexpr bool kTableShifted = false;
alignas(16) constexpr int8_t kInt8Table[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#endif

// block_scales, with MXFP4's m the one its codes here need: -12 d for the shifted table, else 0 (block_scales
// gives MXFP4 none). -12 d is exact: 3 times a power of two.
template <Layout L>
inline void int8_block_scales(const PackedMatrix& w, int64_t G, int64_t s, float* d, float* m) {
  block_scales<L>(w, G, s, d, m);
  if constexpr (Traits<L>::kCodeTable)
    for (int r = 0; r < kGroup; ++r) m[r] = kTableShifted ? -12.0f * d[r] : 0.0f;
}

// Masked nibbles (0..15 in each byte) as the products take them: the codes, or MXFP4's kInt8Table values.
template <Layout L>
inline __m256i int8_codes(__m256i nibbles) {
  if constexpr (!Traits<L>::kCodeTable) return nibbles;
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kInt8Table));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
}

// VPMADDUBSW of codes and x: for signed codes (MXFP4 on AVX2) their magnitudes times x with their signs.
template <Layout L>
inline __m256i pair_products(__m256i codes, __m256i x) {
  if constexpr (Traits<L>::kCodeTable && !kTableShifted)
    return _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes));
  return _mm256_maddubs_epi16(codes, x);
}

#endif

#if defined(__AVX512VNNI__)
constexpr int kPassRows = 8;  // rows of x per pass: their 16 sums and 16 outputs in registers

using Int8Rows = QuantizedRows<int8_t>;

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Word order that makes dword r of a nibble chunk row r's 4 consecutive weights: the chunk's 32-byte half h
// holds row r's weights 2h, 2h + 1 (of its 4) in word r, so dword r takes word r of half 0, then of half 1.
alignas(64) constexpr int16_t kRowQuads[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// out[r][0:16] = group G's products with rows r0 .. r0 + R of x, over all of K (out: the group's first column
// of row 0, in the result or in a thread's tile). Chunk c's low
// nibbles are weights 8c to 8c + 3 of each of the 16 rows, its high nibbles 8c + 4 to 8c + 7 (quantized.h):
// one VPDPBUSD each per row of x. Each block's sums are scaled into fp32 outputs kept in registers.
// A row's block sum is integer, so splitting it over independent chains changes no bit: one or two rows (a
// decode) take a chain per chunk, so the VPDPBUSDs do not wait on each other's latency, and the codes are
// prefetched ahead as the int16 path's are (a decode streams them from memory).
template <Layout L, int R>
void group_pass(const PackedMatrix& w, int64_t G, const Int8Rows& xq, int64_t r0, float* out, int64_t out_stride) {
  constexpr int kChains = R <= 2 ? 4 : 1;
  const int64_t K = w.K, num_blocks = K / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i order = _mm512_load_si512(kRowQuads);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * Traits<L>::kChunks * kChunkBytes;
    __m512i chains[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < kChains; ++k) chains[r][k] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      const __m512i packed = _mm512_loadu_si512(block + c * kChunkBytes);
      __m512i low = _mm512_and_si512(packed, nibble), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      if constexpr (Traits<L>::kCodeTable) {  // unsigned v + 12 (kInt8Table)
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kInt8Table)));
        low = _mm512_shuffle_epi8(table, low);
        high = _mm512_shuffle_epi8(table, high);
      }
      low = _mm512_permutexvar_epi16(order, low);
      high = _mm512_permutexvar_epi16(order, high);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq.codes.data() + (r0 + r) * K + s * kBlock + 8 * c;
        __m512i& chain = chains[r][c % kChains];
        chain = _mm512_dpbusd_epi32(chain, low, broadcast_quad(x));
        chain = _mm512_dpbusd_epi32(chain, high, broadcast_quad(x + 4));
      }
    }
    __m512i dots[R];
    for (int r = 0; r < R; ++r) {
      dots[r] = chains[r][0];
      for (int k = 1; k < kChains; ++k) dots[r] = _mm512_add_epi32(dots[r], chains[r][k]);
    }
    alignas(64) float d[kGroup], m[kGroup];
    int8_block_scales<L>(w, G, s, d, m);
    const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * num_blocks + s;
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(dv, _mm512_set1_ps(xq.scales[i])), y[r]);
      y[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq.sums[i]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * out_stride, y[r]);
}

// Q8_0: signed int8 codes times int8 x. VPDPBUSD takes one operand unsigned, so x goes in as x + 128 (its codes
// with the sign bit flipped: split_for_int8) and the codes as they are, and 128 times each row's code sum over the
// block, one more VPDPBUSD a chunk against 128s shared by the pass's rows, is taken back: exact in int32. The
// same word permute as above makes dword r of a chunk row r's 4 consecutive weights (4c .. 4c + 3). Before,
// Q8_0 matrices (the default model's tied LM head: 12-16% of its 64-row decode step) took int16 x at ~550
// GFLOP/s on AMD family 26, where the 4-bit layouts' int8 passes ran at 600-800.
template <int R>
void group_pass_q8(const PackedMatrix& w, int64_t G, const Int8Rows& xq, int64_t r0, float* out, int64_t out_stride) {
  constexpr int kChains = R <= 2 ? 4 : 1;
  constexpr int kChunks = Traits<Layout::kQ8>::kChunks;
  const int64_t K = w.K, num_blocks = K / kBlock;
  const __m512i order = _mm512_load_si512(kRowQuads), one_twenty_eight = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * kChunks * kChunkBytes;
    __m512i chains[R][kChains], shift = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < kChains; ++k) chains[r][k] = _mm512_setzero_si512();
    for (int c = 0; c < kChunks; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      const __m512i codes = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(block + c * kChunkBytes));
      shift = _mm512_dpbusd_epi32(shift, one_twenty_eight, codes);
      for (int r = 0; r < R; ++r) {
        __m512i& chain = chains[r][c % kChains];
        chain = _mm512_dpbusd_epi32(chain, broadcast_quad(xq.codes.data() + (r0 + r) * K + s * kBlock + 4 * c), codes);
      }
    }
    alignas(64) float d[kGroup], m[kGroup];
    block_scales<Layout::kQ8>(w, G, s, d, m);
    const __m512 dv = _mm512_load_ps(d);
    for (int r = 0; r < R; ++r) {
      __m512i dot = chains[r][0];
      for (int k = 1; k < kChains; ++k) dot = _mm512_add_epi32(dot, chains[r][k]);
      dot = _mm512_sub_epi32(dot, shift);
      const int64_t i = (r0 + r) * num_blocks + s;
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(xq.scales[i])), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * out_stride, y[r]);
}

using GroupPass = void (*)(const PackedMatrix&, int64_t, const Int8Rows&, int64_t, float*, int64_t);

template <Layout L>
GroupPass group_pass_for(int64_t rows) {
  if constexpr (L == Layout::kQ8)
    return with_row_count<kPassRows>(rows, [](auto R) -> GroupPass { return group_pass_q8<R.value>; });
  else
    return with_row_count<kPassRows>(rows, [](auto R) -> GroupPass { return group_pass<L, R.value>; });
}

template <Layout L, typename In>
void matmul_impl(const In* x, int64_t M, const PackedMatrix& w, int64_t num_groups, float* out,
                 int64_t out_stride, GroupOutput to) {
  static_assert((Traits<L>::kCodeBits == 4 && (Traits<L>::kOffsets || Traits<L>::kCodeTable) ||
                 L == Layout::kQ8) && Traits<L>::kScaleWeights == kBlock);
  const Int8Split split = split_for_int8<L == Layout::kQ8>(x, M, w.K);  // Q8_0's x + 128 (group_pass_q8)
  const Int8Rows& xq = split.rows;
  const GroupPass full = group_pass_for<L>(kPassRows), rest = group_pass_for<L>(M % kPassRows);
  // Runs of consecutive groups in guided shares (about 16 a call, as the int16 path's), so that each thread
  // streams consecutive codes: handed out one group at a time, the threads' interleaved groups made a
  // 16-row decode step 1.4x the int16 path's time (AMD family 26), the kernel alone being 0.7x.
  run_groups(M, num_groups, out, out_stride, to, /*fine=*/false, [&](int64_t G, float* y, int64_t stride) {
    for (int64_t r0 = 0; r0 < M; r0 += kPassRows) (M - r0 >= kPassRows ? full : rest)(w, G, xq, r0, y, stride);
    add_outlier_products<L>(w, G, split.outliers, y, stride);
  });
}
#elif defined(__AVX2__)
constexpr int kPassRows = 4;  // rows of x per pass: 2 int16 sums each plus a chunk's 4 operands fit 16 registers

using Int8Rows = QuantizedRows<int8_t>;

inline __m256i broadcast_pair(const int8_t* p) {
  int16_t v;
  std::memcpy(&v, p, 2);
  return _mm256_set1_epi16(v);
}

// acc[r][0:16] += the block's products for rows r0 .. r0 + R of x.
template <Layout L, int R>
void block_rows(const uint8_t* block, const float* d, const float* m, const Int8Rows& xq, int64_t r0, int64_t K,
                int64_t s, float* acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i sums[R][2];  // int16 row sums of pairs 0-7 and 8-15
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes));
    const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + 32));
    const __m256i operand[4] = {  // pairs 4c, 4c + 1, 4c + 2, 4c + 3
        int8_codes<L>(_mm256_and_si256(half0, nibble)), int8_codes<L>(_mm256_and_si256(half1, nibble)),
        int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half0, 4), nibble)),
        int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half1, 4), nibble))};
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq.codes.data() + (r0 + r) * K + s * kBlock + 8 * c;
      for (int o = 0; o < 4; ++o)
        sums[r][c / 2] = _mm256_add_epi16(sums[r][c / 2], pair_products<L>(operand[o], broadcast_pair(x + 2 * o)));
    }
  }
  const int64_t num_blocks = K / kBlock;
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * num_blocks + s;
    const __m256 dx = _mm256_set1_ps(xq.scales[i]), sum_x = _mm256_set1_ps(xq.sums[i]);
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
      const __m128i a = h == 0 ? _mm256_castsi256_si128(sums[r][0]) : _mm256_extracti128_si256(sums[r][0], 1);
      const __m128i b = h == 0 ? _mm256_castsi256_si128(sums[r][1]) : _mm256_extracti128_si256(sums[r][1], 1);
      const __m256i dot = _mm256_add_epi32(_mm256_cvtepi16_epi32(a), _mm256_cvtepi16_epi32(b));
      float* out = acc + (r0 + r) * kGroup + 8 * h;
      __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), dx),
                                 _mm256_loadu_ps(out));
      y = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8 * h), sum_x, y);
      _mm256_storeu_ps(out, y);
    }
  }
}

using BlockRows = void (*)(const uint8_t*, const float*, const float*, const Int8Rows&, int64_t, int64_t, int64_t,
                           float*);

template <Layout L>
BlockRows block_rows_for(int64_t rows) {
  return with_row_count<kPassRows>(rows, [](auto R) -> BlockRows { return block_rows<L, R.value>; });
}

// A decode step's few rows (up to kFewRows) on AVX2: the int16 path's VPMADDWD takes a
// widened operand and an add per 2 products (quantized_linear.cpp), which held a batch-1 decode on Zen 2 to
// 43-47% of the memory's read bandwidth; here VPMADDUBSW takes the packed nibbles as they are. Each row's
// 4 consecutive weights are made one dword (the 32-byte halves' words interleaved), so that x is broadcast
// 4 bytes at a time (ByteDots sums them). The interleave leaves rows 0-3 and 8-11 in one register, 4-7 and
// 12-15 in the other ("a" and "b"); d and m are read in the same order. With AVX-VNNI every row count takes
// these passes (matmul_impl): VPDPBUSD needs a row's 4 weights in a dword, which block_rows' pairs are not.
constexpr int kFewRowsPass = 4;  // rows of x a pass: 4 accumulators and 4 int16 sums each beside the operands

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

template <Layout L, int R>
void group_few_rows(const PackedMatrix& w, int64_t G, const Int8Rows& xq, int64_t first_row, float* out,
                    int64_t out_stride) {
  const int64_t K = w.K, num_blocks = K / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const uint8_t* codes = w.codes + G * w.group_bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = codes + s * Traits<L>::kChunks * kChunkBytes;
    ByteDots<L> dots[R][2];
    for (int c = 0; c < 4; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes));
      const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + 32));
      // Low nibbles: weights 8c .. 8c + 3 of each row; high nibbles: 8c + 4 .. 8c + 7.
      const __m256i low0 = int8_codes<L>(_mm256_and_si256(half0, nibble));
      const __m256i low1 = int8_codes<L>(_mm256_and_si256(half1, nibble));
      const __m256i high0 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half0, 4), nibble));
      const __m256i high1 = int8_codes<L>(_mm256_and_si256(_mm256_srli_epi16(half1, 4), nibble));
      const __m256i low_a = _mm256_unpacklo_epi16(low0, low1), low_b = _mm256_unpackhi_epi16(low0, low1);
      const __m256i high_a = _mm256_unpacklo_epi16(high0, high1), high_b = _mm256_unpackhi_epi16(high0, high1);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq.codes.data() + (first_row + r) * K + s * kBlock + 8 * c;
        int32_t first, second;
        std::memcpy(&first, x, 4);
        std::memcpy(&second, x + 4, 4);
        const __m256i x_low = _mm256_set1_epi32(first), x_high = _mm256_set1_epi32(second);
        dots[r][0].add(low_a, x_low, high_a, x_high);
        dots[r][1].add(low_b, x_low, high_b, x_high);
      }
    }
    alignas(32) float d[kGroup], m[kGroup];
    int8_block_scales<L>(w, G, s, d, m);
    const __m256 d_a = _mm256_loadu2_m128(d + 8, d), d_b = _mm256_loadu2_m128(d + 12, d + 4);
    const __m256 m_a = _mm256_loadu2_m128(m + 8, m), m_b = _mm256_loadu2_m128(m + 12, m + 4);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first_row + r) * num_blocks + s;
      const __m256 dx = _mm256_set1_ps(xq.scales[i]), sum_x = _mm256_set1_ps(xq.sums[i]);
      const __m256 dot_a = _mm256_cvtepi32_ps(dots[r][0].int32());
      const __m256 dot_b = _mm256_cvtepi32_ps(dots[r][1].int32());
      acc[r][0] = _mm256_fmadd_ps(m_a, sum_x, _mm256_fmadd_ps(dot_a, _mm256_mul_ps(d_a, dx), acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(m_b, sum_x, _mm256_fmadd_ps(dot_b, _mm256_mul_ps(d_b, dx), acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {  // rows 0-3 | 8-11 and 4-7 | 12-15 back in order
    float* y = out + (first_row + r) * out_stride;
    _mm256_storeu2_m128(y + 8, y, acc[r][0]);
    _mm256_storeu2_m128(y + 12, y + 4, acc[r][1]);
  }
}

using GroupFewRows = void (*)(const PackedMatrix&, int64_t, const Int8Rows&, int64_t, float*, int64_t);

template <Layout L>
GroupFewRows group_few_rows_for(int64_t rows) {
  return with_row_count<kFewRowsPass>(rows, [](auto R) -> GroupFewRows { return group_few_rows<L, R.value>; });
}

template <Layout L, typename In>
void matmul_impl(const In* x, int64_t M, const PackedMatrix& w, int64_t num_groups, float* out,
                 int64_t out_stride, GroupOutput to) {
  static_assert(Traits<L>::kCodeBits == 4 && (Traits<L>::kOffsets || Traits<L>::kCodeTable) &&
                Traits<L>::kScaleWeights == kBlock);
  const int64_t K = w.K, num_blocks = K / kBlock;
  const Int8Split split = split_for_int8(x, M, K);
  const Int8Rows& xq = split.rows;
#if defined(__AVXVNNI__)
  constexpr bool kAllRowsInPasses = true;
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
    thread_local std::vector<float> acc;  // block_rows sums into rows of 16
    acc.assign(M * kGroup, 0.0f);
    for (int64_t s = 0; s < num_blocks; ++s) {
      alignas(32) float d[kGroup], m[kGroup];
      int8_block_scales<L>(w, G, s, d, m);
      const uint8_t* block = w.codes + G * w.group_bytes + s * Traits<L>::kChunks * kChunkBytes;
      for (int64_t r0 = 0; r0 < M; r0 += kPassRows)
        block_rows_for<L>(std::min<int64_t>(kPassRows, M - r0))(block, d, m, xq, r0, K, s, acc.data());
    }
    for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * stride, acc.data() + r * kGroup, kGroup * sizeof(float));
    add_outlier_products<L>(w, G, split.outliers, y, stride);
  });
}
#endif

}  // namespace

namespace serval_kernels::quantized {

bool has_int8_rows(Layout layout) {
#if defined(__AVX512VNNI__)
  return layout == Layout::kQ4 || layout == Layout::kQ4Sym || layout == Layout::kQ4K || layout == Layout::kMXFP4 ||
         layout == Layout::kQ8;
#elif defined(__AVX2__)
  return layout == Layout::kQ4 || layout == Layout::kQ4Sym || layout == Layout::kQ4K || layout == Layout::kMXFP4;
#else
  (void)layout;
  return false;
#endif
}

template <typename In>
void int8_rows_matmul(const In* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                      float* out, int64_t out_stride, GroupOutput to) {
  TORCH_CHECK(has_int8_rows(layout), "no int8-activation path for this layout in this build");
#if defined(__AVX2__)
  switch (layout) {
    case Layout::kQ4: matmul_impl<Layout::kQ4>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kQ4Sym: matmul_impl<Layout::kQ4Sym>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kQ4K: matmul_impl<Layout::kQ4K>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kMXFP4: matmul_impl<Layout::kMXFP4>(x, M, w, num_groups, out, out_stride, to); break;
#if defined(__AVX512VNNI__)
    case Layout::kQ8: matmul_impl<Layout::kQ8>(x, M, w, num_groups, out, out_stride, to); break;
#endif
    default: break;
  }
#else
  (void)x, (void)M, (void)w, (void)num_groups, (void)out, (void)out_stride, (void)to;
#endif
}

void matmul_int8_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                      float* out, int64_t out_stride, GroupOutput to) {
  int8_rows_matmul(x, M, w, layout, num_groups, out, out_stride, to);
}

void matmul_int8_rows(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                      float* out, int64_t out_stride, GroupOutput to) {
  int8_rows_matmul(x, M, w, layout, num_groups, out, out_stride, to);
}

}  // namespace serval_kernels::quantized

// A decode step's few rows take int8 too, so that a row's numbers are the same alone and in any batch (the
// batch-invariance rule: a row's x is rounded the same way whatever M). On AVX2 VPMADDUBSW (AVX-VNNI's
// VPDPBUSD) outpaces the int16 path's products at every row count (1.2-1.6x at 1-8 rows,
// docs/benchmarks/2026-12-02.md). With AVX-512-VNNI a lone row takes the same time either way, and since x is
// rounded on every thread and the groups stream in runs (2026-12-06) a 16-row decode step is level with
// int16's and larger batches faster (kernels.default_batch_activations).
int64_t int8_rows_from() {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}
