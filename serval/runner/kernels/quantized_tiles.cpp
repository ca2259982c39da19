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

constexpr int64_t kSliceWeights = 256;  // of K: a 16 KB fp32 slice
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

// Scale block s of group G into w[k][16], fp32.
template <Layout L>
inline void dequantize_block(const PackedMatrix& pm, int64_t G, int64_t s, float* w) {
  using T = Traits<L>;
  alignas(32) float d[kGroup], m[kGroup] = {};
  block_scales<L>(pm, G, s, d, m);
  const uint8_t* block = pm.codes + G * pm.group_bytes + s * T::kChunks * kChunkBytes;
#if defined(__AVX2__)
  // Each 32-byte half of a chunk holds (row, element) byte pairs of rows 0-7, then rows 8-15; one shuffle
  // per 128-bit lane puts element 0 of the 8 rows before element 1, so each weight's 8 rows are 8 bytes.
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256 dv[2] = {_mm256_load_ps(d), _mm256_load_ps(d + 8)};
  const __m256 mv[2] = {_mm256_load_ps(m), _mm256_load_ps(m + 8)};
  for (int c = 0; c < T::kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      const __m256i raw = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + h * 32)), split);
      if constexpr (T::kFourBit) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i low = _mm256_and_si256(raw, nibble), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        for (int e = 0; e < 2; ++e) {
          store_weight_rows<false>(low, 8 * e, dv, mv, w + (2 * (4 * c + h) + e) * kGroup);
          store_weight_rows<false>(high, 8 * e, dv, mv, w + (2 * (4 * c + 2 + h) + e) * kGroup);
        }
      } else {
        for (int e = 0; e < 2; ++e) store_weight_rows<true>(raw, 8 * e, dv, mv, w + (2 * (2 * c + h) + e) * kGroup);
      }
    }
  }
#else
  int16_t q[T::kScaleWeights][kGroup];
  unpack_block<L>(block, q);
  for (int k = 0; k < T::kScaleWeights; ++k)
    for (int n = 0; n < kGroup; ++n) w[k * kGroup + n] = d[n] * static_cast<float>(q[k][n]) + m[n];
#endif
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

template <Layout L>
void matmul_impl(const float* x, int64_t M, const PackedMatrix& pm, int64_t num_groups, float* out,
                 int64_t out_stride) {
  constexpr int64_t kSliceScaleBlocks = kSliceWeights / Traits<L>::kScaleWeights;
  const int64_t K = pm.K, num_scale_blocks = K / Traits<L>::kScaleWeights;
  parallel_chunks(num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> slice(kSliceWeights * kGroup);
    for (int64_t G = begin; G < end; ++G) {
      for (int64_t s0 = 0; s0 < num_scale_blocks; s0 += kSliceScaleBlocks) {
        const int64_t blocks = std::min(kSliceScaleBlocks, num_scale_blocks - s0);
        for (int64_t i = 0; i < blocks; ++i)
          dequantize_block<L>(pm, G, s0 + i, slice.data() + i * Traits<L>::kScaleWeights * kGroup);
        const int64_t k0 = s0 * Traits<L>::kScaleWeights;
        for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
          const TileRows run = tile_rows_for(std::min<int64_t>(kTileRows, M - r0),
                                             std::make_integer_sequence<int, kTileRows>());
          run(slice.data(), blocks * Traits<L>::kScaleWeights, x + r0 * K + k0, K, out + r0 * out_stride + G * kGroup,
              out_stride, k0 > 0);
        }
      }
    }
  }, Schedule::kDynamic);
}

}  // namespace

namespace serval_kernels::quantized {

void matmul_dequantized_tiles(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                              float* out, int64_t out_stride) {
  switch (layout) {
    case Layout::kQ4: matmul_impl<Layout::kQ4>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ4Sym: matmul_impl<Layout::kQ4Sym>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ8: matmul_impl<Layout::kQ8>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ8Min: matmul_impl<Layout::kQ8Min>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ4K: matmul_impl<Layout::kQ4K>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ8K: matmul_impl<Layout::kQ8K>(x, M, w, num_groups, out, out_stride); break;
    case Layout::kQ8K16: matmul_impl<Layout::kQ8K16>(x, M, w, num_groups, out, out_stride); break;
  }
}

}  // namespace serval_kernels::quantized
