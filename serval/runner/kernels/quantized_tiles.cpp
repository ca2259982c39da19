// Packed 4- to 8-bit weights times many rows of x (prefill, large decode batches): each thread dequantizes
// a slice of one group's weights (16 output rows x 256 of K) into fp32 in L1, then an FMA micro-kernel runs
// every row of x over it, a few rows at a time with their accumulators in registers.
//
// Memory stays at the packed size: no dense copy of the matrix is ever made, only the per-thread slice.
// The products are of the file's exact weights and x in fp32, so this path is closer to fp32 than the bf16
// matmul and the int16 activations of the few-row kernel. Dequantizing costs once per slice whatever M is;
// the FMAs cost M times, so from a dozen rows on the FMAs dominate. With bf16 activations on AVX512-BF16 the
// slice is dequantized into bf16 pairs instead and multiplied with VDPBF16PS (below): a bf16 model's answer.
//
// x is first regrouped a tile of rows at a time (interleave_tiles), so that the values one step broadcasts
// share a cache line: taken from x's rows directly, Llama's 4 KB-multiple row lengths put them all in one L1
// set (on 2048 x 8192, 2.8 -> 1.8 ms at 9 rows, 40 -> 17 ms at 137).
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
  if constexpr (T::kNibbles) {
    __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // in the same byte order as `raw`
    for (int h = 0; h < 2 && T::kHighBits > 0; ++h)
      high[h] = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + T::kNibbleChunks * kChunkBytes + h * 32)), split);
    for (int c = 0; c < T::kNibbleChunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_shuffle_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + h * 32)), split);
        const __m256i low = nibble_codes<L>(raw, high[h], c, 0), top = nibble_codes<L>(raw, high[h], c, 1);
        for (int e = 0; e < 2; ++e) {
          store_weight_rows<T::kSignedCodes>(low, 8 * e, dv, mv, w + (2 * (4 * c + h) + e) * kGroup);
          store_weight_rows<T::kSignedCodes>(top, 8 * e, dv, mv, w + (2 * (4 * c + 2 + h) + e) * kGroup);
        }
      }
    }
  } else {
    for (int c = 0; c < T::kChunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_shuffle_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + h * 32)), split);
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

// x's rows regrouped a tile at a time, column-major within the tile: element (k, r) of tile t at
// ((t K + k) R + r), rows past M zero. The micro-kernel then reads the R values it broadcasts for one k from
// one cache line; read from x itself they would lie a row (K elements) apart, and where a row is a multiple
// of 4 KB (K = 2048, 8192: every Llama size) all R of them fall in the same L1 set, which holds 8.
template <typename T, int R>
std::vector<T> interleave_tiles(const T* x, int64_t M, int64_t K) {
  const int64_t tiles = (M + R - 1) / R;
  std::vector<T> tiled(tiles * K * R, T{});
  parallel_chunks(tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < std::min<int64_t>(R, M - t * R); ++r)
        for (int64_t k = 0; k < K; ++k) tiled[(t * K + k) * R + r] = x[(t * R + r) * K + k];
  });
  return tiled;
}

// out[r, 0:16] (+)= sum_k x[r, k] w[k, 0:16] for R rows; x a tile of interleave_tiles<float, kTileRows>.
template <int R>
void tile_rows(const float* w, int64_t k_len, const float* x, float* out, int64_t out_stride, bool accumulate) {
  using simd::Vec;
  constexpr int W = simd::kWidth, V = kGroup / W;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = accumulate ? simd::load(out + r * out_stride + v * W) : simd::zero();
  for (int64_t k = 0; k < k_len; ++k) {
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = simd::load(w + k * kGroup + v * W);
    for (int r = 0; r < R; ++r) {
      const Vec xb = simd::set1(x[k * kTileRows + r]);
      for (int v = 0; v < V; ++v) acc[r][v] = simd::fmadd(wv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) simd::store(out + r * out_stride + v * W, acc[r][v]);
}

using TileRows = void (*)(const float*, int64_t, const float*, float*, int64_t, bool);

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
  const std::vector<float> tiled = interleave_tiles<float, kTileRows>(x, M, K);
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
          run(slice.data(), blocks * Traits<L>::kScaleWeights, tiled.data() + (r0 * K + k0 * kTileRows),
              out + r0 * out_stride + G * kGroup, out_stride, k0 > 0);
        }
      }
    }
  }, Schedule::kDynamic);
}

#if defined(__AVX512BF16__)
// The bf16 form of the same loop, for bf16 activations (the model's compute dtype where the CPU has
// AVX512-BF16): VDPBF16PS multiplies 32 bf16 pairs an instruction, twice the fp32 FMA's products, and sums
// each pair into fp32. The weights are rounded from their exact fp32 value to bf16 in registers, which is
// the rounding a dense bf16 copy of the matrix would make, so this path answers what oneDNN's bf16 matmul
// over such a copy answers (up to summation order) without the copy: 2 bytes a weight that larger batches
// used to keep beside the packed codes.
//
// A slice is stored as VDPBF16PS takes its first operand: vector p holds, in 32-bit lane n, row n's weights
// 2p and 2p + 1. That is the packed codes' own byte order (each 32-byte half of a chunk is 16 rows x 2
// consecutive weights), so a half widens to one vector with no shuffle.
// A micro-kernel pass: kBf16TileRows rows of x times kBf16Groups groups of 16 outputs, one accumulator each
// (24 of the 32 registers). 16 x 1, 8 x 2 and 6 x 4 measured within the noise of this choice; 16 x 1 was
// 10-20% slower at 137 rows (one broadcast load per product).
constexpr int kBf16TileRows = 12;
constexpr int64_t kBf16Groups = 2;
constexpr int64_t kSlicePairs = kSliceWeights / 2;  // vectors of a group's slice

template <bool kSigned>
inline __m512i bf16_pairs(__m256i bytes, const __m512 d[2], const __m512 m[2]) {
  __m512 w[2];
  for (int h = 0; h < 2; ++h) {
    const __m128i lane = h == 0 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
    const __m512i q = kSigned ? _mm512_cvtepi8_epi32(lane) : _mm512_cvtepu8_epi32(lane);
    w[h] = _mm512_fmadd_ps(d[h], _mm512_cvtepi32_ps(q), m[h]);
  }
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));  // w[0] in the low half
}

template <Layout L>
inline void dequantize_block_bf16(const PackedMatrix& pm, int64_t G, int64_t s, __m512i* pairs) {
  using T = Traits<L>;
  alignas(64) float d[kGroup], m[kGroup] = {};
  block_scales<L>(pm, G, s, d, m);
  // Lanes 2r and 2r + 1 of a half's 16 weights belong to row r (rows 0-7, then 8-15).
  const __m512i rows_low = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i rows_high = _mm512_add_epi32(rows_low, _mm512_set1_epi32(8));
  const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
  const __m512 dr[2] = {_mm512_permutexvar_ps(rows_low, dv), _mm512_permutexvar_ps(rows_high, dv)};
  const __m512 mr[2] = {_mm512_permutexvar_ps(rows_low, mv), _mm512_permutexvar_ps(rows_high, mv)};
  const uint8_t* block = pm.codes + G * pm.group_bytes + s * T::kChunks * kChunkBytes;
  if constexpr (T::kNibbles) {
    __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int h = 0; h < 2 && T::kHighBits > 0; ++h)
      high[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + T::kNibbleChunks * kChunkBytes + h * 32));
    for (int c = 0; c < T::kNibbleChunks; ++c) {
      for (int h = 0; h < 2; ++h) {  // low nibbles: pair 4c + h; high nibbles: pair 4c + 2 + h
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + h * 32));
        pairs[4 * c + h] = bf16_pairs<T::kSignedCodes>(nibble_codes<L>(raw, high[h], c, 0), dr, mr);
        pairs[4 * c + 2 + h] = bf16_pairs<T::kSignedCodes>(nibble_codes<L>(raw, high[h], c, 1), dr, mr);
      }
    }
  } else {
    for (int c = 0; c < T::kChunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * kChunkBytes + h * 32));
        pairs[2 * c + h] = bf16_pairs<true>(raw, dr, mr);
      }
    }
  }
}

// out[r, 16 g : 16 g + 16] (+)= sum_p x[r, pair p] . w_g[pair p, 0:16] for R rows and NG groups side by side
// (w_g: the slice of group g, kSlicePairs vectors each); x a tile of 32-bit bf16 pairs from interleave_tiles.
// NG groups share each broadcast of x: a load per NG products instead of one each.
template <int NG, int R>
void tile_rows_bf16(const __m512i* w, int64_t num_pairs, const uint32_t* x, float* out, int64_t out_stride,
                    bool accumulate) {
  __m512 acc[R][NG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      acc[r][g] = accumulate ? _mm512_loadu_ps(out + r * out_stride + g * kGroup) : _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    __m512bh wv[NG];
    for (int g = 0; g < NG; ++g) wv[g] = reinterpret_cast<__m512bh>(_mm512_load_si512(w + g * kSlicePairs + p));
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[p * kBf16TileRows + r])));
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv[g], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out + r * out_stride + g * kGroup, acc[r][g]);
}

using TileRowsBf16 = void (*)(const __m512i*, int64_t, const uint32_t*, float*, int64_t, bool);

template <int NG, int... Rows>
TileRowsBf16 tile_rows_bf16_for(int64_t rows, std::integer_sequence<int, Rows...>) {
  TileRowsBf16 run = nullptr;
  ((rows == Rows + 1 ? (run = tile_rows_bf16<NG, Rows + 1>, 0) : 0), ...);
  return run;
}

template <Layout L>
void matmul_bf16_impl(const at::BFloat16* x, int64_t M, const PackedMatrix& pm, int64_t num_groups, float* out,
                      int64_t out_stride) {
  using T = Traits<L>;
  constexpr int64_t kSliceScaleBlocks = kSliceWeights / T::kScaleWeights;
  const int64_t K = pm.K, num_scale_blocks = K / T::kScaleWeights;
  const std::vector<uint32_t> tiled =
      interleave_tiles<uint32_t, kBf16TileRows>(reinterpret_cast<const uint32_t*>(x), M, K / 2);
  const int64_t num_blocks = (num_groups + kBf16Groups - 1) / kBf16Groups;
  parallel_chunks(num_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) __m512i slice[kBf16Groups * kSlicePairs];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t G0 = b * kBf16Groups, groups = std::min(kBf16Groups, num_groups - G0);
      for (int64_t s0 = 0; s0 < num_scale_blocks; s0 += kSliceScaleBlocks) {
        const int64_t blocks = std::min(kSliceScaleBlocks, num_scale_blocks - s0);
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t i = 0; i < blocks; ++i)
            dequantize_block_bf16<L>(pm, G0 + g, s0 + i, slice + g * kSlicePairs + i * T::kScaleWeights / 2);
        const int64_t k0 = s0 * T::kScaleWeights;
        for (int64_t r0 = 0; r0 < M; r0 += kBf16TileRows) {
          const int64_t rows = std::min<int64_t>(kBf16TileRows, M - r0);
          const auto all_rows = std::make_integer_sequence<int, kBf16TileRows>();
          const TileRowsBf16 run = groups == kBf16Groups ? tile_rows_bf16_for<kBf16Groups>(rows, all_rows)
                                                         : tile_rows_bf16_for<1>(rows, all_rows);
          for (int64_t g = 0; g < groups; g += (groups == kBf16Groups ? kBf16Groups : 1)) {
            run(slice + g * kSlicePairs, blocks * T::kScaleWeights / 2,
                tiled.data() + (r0 * K / 2 + k0 / 2 * kBf16TileRows), out + r0 * out_stride + (G0 + g) * kGroup,
                out_stride, k0 > 0);
          }
        }
      }
    }
  }, Schedule::kDynamic);
}
#endif

}  // namespace

namespace serval_kernels::quantized {

bool has_bf16_tiles() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void matmul_bf16_tiles(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                       float* out, int64_t out_stride) {
#if defined(__AVX512BF16__)
  with_layout(layout, [&](auto L) { matmul_bf16_impl<decltype(L)::value>(x, M, w, num_groups, out, out_stride); });
#else
  TORCH_CHECK(false, "no bf16 products in this build (AVX512-BF16)");
#endif
}

void matmul_dequantized_tiles(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                              float* out, int64_t out_stride) {
  with_layout(layout, [&](auto L) { matmul_impl<decltype(L)::value>(x, M, w, num_groups, out, out_stride); });
}

}  // namespace serval_kernels::quantized
