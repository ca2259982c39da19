// Packed 4-bit / 8-bit weights times many rows of x (prefill, large decode batches): each thread dequantizes
// a slice of one group's weights (16 output rows x 256 of K) into fp32 in L1, then an FMA micro-kernel runs
// every row of x over it, a few rows at a time with their accumulators in registers.
//
// Memory stays at the packed size: no dense copy of the matrix is ever made, only the per-thread slice.
// The products are of the file's exact weights and x in fp32, so this path is closer to fp32 than the bf16
// matmul and the int16 activations of the few-row kernel. Dequantizing costs once per slice whatever M is;
// the FMAs cost M times, so from a dozen rows on the FMAs dominate.
#include "quantized.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

constexpr int64_t kSliceBlocks = 8;  // 256 weights of K: a 16 KB fp32 slice
// Rows of x per micro-kernel pass: R * 16 / kWidth accumulators plus the weight vectors fit the registers
// (AVX-512: 8 + 1 of 32; AVX2 and portable: 12 + 2 of 16).
constexpr int kTileRows = simd::kWidth == 16 ? 8 : 6;

#if defined(__AVX2__)
// The 16 codes of weight k in rows 0-7 (lane 0 of `bytes`) and 8-15 (lane 1), bytes at offset `at` of each
// lane, as w = d q + m in fp32.
template <bool kSigned>
inline void store_weight_rows(__m256i bytes, int at, const __m256 d[2], const __m256 m[2], float* w) {
  for (int h = 0; h < 2; ++h) {
    const __m128i lane = h == 0 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
    const __m128i shifted = at == 0 ? lane : _mm_srli_si128(lane, 8);
    const __m256i q = kSigned ? _mm256_cvtepi8_epi32(shifted) : _mm256_cvtepu8_epi32(shifted);
    _mm256_storeu_ps(w + 8 * h, _mm256_fmadd_ps(d[h], _mm256_cvtepi32_ps(q), m[h]));
  }
}
#endif

// One block of one group into w[k][16], fp32.
template <bool kFourBit>
inline void dequantize_block(const uint8_t* block, const at::Half* scales, const at::Half* offsets, float* w) {
#if defined(__AVX2__)
  // Each 32-byte half of a chunk holds (row, element) byte pairs of rows 0-7, then rows 8-15; one shuffle
  // per 128-bit lane puts element 0 of the 8 rows before element 1, so each weight's 8 rows are 8 bytes.
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))),
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 8)))};
  const __m256 m[2] = {kFourBit ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets)))
                                : _mm256_setzero_ps(),
                       kFourBit ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets + 8)))
                                : _mm256_setzero_ps()};
  constexpr int kChunks = kFourBit ? 4 : 8;
  for (int c = 0; c < kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i raw = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * 64 + h * 32)), split);
      if constexpr (kFourBit) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i low = _mm256_and_si256(raw, nibble), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        for (int e = 0; e < 2; ++e) {
          store_weight_rows<false>(low, 8 * e, d, m, w + (2 * (4 * c + h) + e) * kGroup);
          store_weight_rows<false>(high, 8 * e, d, m, w + (2 * (4 * c + 2 + h) + e) * kGroup);
        }
      } else {
        for (int e = 0; e < 2; ++e) store_weight_rows<true>(raw, 8 * e, d, m, w + (2 * (2 * c + h) + e) * kGroup);
      }
    }
  }
#else
  int16_t q[kBlock][kGroup];
  unpack_block<kFourBit>(block, q);
  float d[kGroup], m[kGroup];
  for (int n = 0; n < kGroup; ++n) {
    d[n] = static_cast<float>(scales[n]);
    m[n] = kFourBit ? static_cast<float>(offsets[n]) : 0.0f;
  }
  for (int k = 0; k < kBlock; ++k)
    for (int n = 0; n < kGroup; ++n) w[k * kGroup + n] = d[n] * static_cast<float>(q[k][n]) + m[n];
#endif
}

template <bool kFourBit>
void dequantize_slice(const uint8_t* codes, const at::Half* scales, const at::Half* offsets, int64_t b0,
                      int64_t num_blocks, float* w) {  // w: (num_blocks * 32, 16)
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t b = b0 + i;
    dequantize_block<kFourBit>(codes + b * block_bytes(kFourBit), scales + b * kGroup, offsets + b * kGroup,
                               w + i * kBlock * kGroup);
  }
}

// out[r, 0:16] (+)= sum_k x[r, k] w[k, 0:16] for R rows.
template <int R>
void tile_rows(const float* w, int64_t k_len, const float* x, int64_t x_stride, float* out, int64_t out_stride,
               bool accumulate) {
  using simd::Vec;
  constexpr int W = simd::kWidth, V = kGroup / W;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = accumulate ? simd::load(out + r * out_stride + v * W) : simd::zero();
  for (int64_t k = 0; k < k_len; ++k) {
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = simd::load(w + k * kGroup + v * W);
    for (int r = 0; r < R; ++r) {
      const Vec xb = simd::set1(x[r * x_stride + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = simd::fmadd(wv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) simd::store(out + r * out_stride + v * W, acc[r][v]);
}

using TileRows = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

template <int... Rows>
TileRows tile_rows_for(int64_t rows, std::integer_sequence<int, Rows...>) {
  TileRows run = nullptr;
  ((rows == Rows + 1 ? (run = tile_rows<Rows + 1>, 0) : 0), ...);
  return run;
}

template <bool kFourBit>
void matmul_impl(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t group_bytes,
                 const at::Half* scales, const at::Half* offsets, int64_t num_groups, float* out,
                 int64_t out_stride) {
  const int64_t num_blocks = K / kBlock;
  parallel_chunks(num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> slice(kSliceBlocks * kBlock * kGroup);
    for (int64_t G = begin; G < end; ++G) {
      for (int64_t b0 = 0; b0 < num_blocks; b0 += kSliceBlocks) {
        const int64_t blocks = std::min(kSliceBlocks, num_blocks - b0);
        dequantize_slice<kFourBit>(codes + G * group_bytes, scales + G * num_blocks * kGroup,
                                   offsets + G * num_blocks * kGroup, b0, blocks, slice.data());
        for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
          const TileRows run = tile_rows_for(std::min<int64_t>(kTileRows, M - r0),
                                             std::make_integer_sequence<int, kTileRows>());
          run(slice.data(), blocks * kBlock, x + r0 * K + b0 * kBlock, K, out + r0 * out_stride + G * kGroup,
              out_stride, b0 > 0);
        }
      }
    }
  }, Schedule::kDynamic);
}

}  // namespace

namespace serval_kernels::quantized {

void matmul_dequantized_tiles(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t group_bytes,
                              const at::Half* scales, const at::Half* offsets, bool four_bit, int64_t num_groups,
                              float* out, int64_t out_stride) {
  if (four_bit) matmul_impl<true>(x, M, K, codes, group_bytes, scales, offsets, num_groups, out, out_stride);
  else matmul_impl<false>(x, M, K, codes, group_bytes, scales, offsets, num_groups, out, out_stride);
}

}  // namespace serval_kernels::quantized
