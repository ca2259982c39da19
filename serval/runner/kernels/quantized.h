// The packed low-bit weight layouts shared by quantized_linear.cpp (few rows of x: integer dot products) and
// quantized_tiles.cpp (many rows: weights dequantized a tile at a time, fp32 FMAs). The byte layout of the
// codes is described in quantized_linear.cpp; serval/runner/quantization.py writes them.
//
// Every layout stores codes (4-bit in nibbles, or int8) in groups of 16 output rows, and for each row and
// scale block of 16 or 32 weights a scale d and, where the format has one, an offset m: w = d q + m. The
// layouts differ only in how d and m are stored:
//   kQ4     4-bit codes, fp16 d and m per 32 (GGUF Q4_1)
//   kQ4Sym  4-bit codes, fp16 d per 32, m = -8 d (Q4_0: w = d (q - 8))
//   kQ8     int8 codes, fp16 d per 32, no m (Q8_0; Q5_0 as q - 16)
//   kQ8Min  int8 codes, fp16 d and m per 32 (Q5_1)
//   kQ4K    4-bit codes; per 256 an fp16 d and -dmin, per 32 a 6-bit scale and min: d = D sc, m = -Dmin mn
//           (Q4_K)
//   kQ8K    the same with int8 codes (Q5_K)
//   kQ8K16  int8 codes, per 256 an fp16 D, per 16 an int8 scale: d = D sc, no m (Q6_K as q - 32)
// d and m are formed in fp32 exactly as ggml's dequantizers form them, so w is the file's weight bit for bit.
#pragma once
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "simd.h"

namespace serval_kernels::quantized {

constexpr int64_t kBlock = 32;        // weights per block along K (x is quantized per block)
constexpr int64_t kGroup = 16;        // output rows per packed group
constexpr int64_t kSuperWeights = 256;  // weights per k-quant super-block
constexpr int64_t kChunkBytes = 64;

enum class Layout { kQ4, kQ4Sym, kQ8, kQ8Min, kQ4K, kQ8K, kQ8K16 };

template <Layout L>
struct Traits {
  static constexpr bool kFourBit = L == Layout::kQ4 || L == Layout::kQ4Sym || L == Layout::kQ4K;
  static constexpr bool kSuper = L == Layout::kQ4K || L == Layout::kQ8K || L == Layout::kQ8K16;
  static constexpr bool kOffsets = L != Layout::kQ8 && L != Layout::kQ8K16;
  static constexpr int64_t kScaleWeights = L == Layout::kQ8K16 ? 16 : 32;  // weights per d (and m)
  static constexpr int kChunks = static_cast<int>(kScaleWeights / (kFourBit ? 8 : 4));  // 64-byte chunks per d
  using SubScale = std::conditional_t<L == Layout::kQ8K16, int8_t, uint8_t>;
};

// f(std::integral_constant<Layout, L>{}) for the layout known at run time: the one switch from a matrix's
// layout to a kernel compiled for it.
template <typename F>
decltype(auto) with_layout(Layout layout, F&& f) {
  switch (layout) {
    case Layout::kQ4: return f(std::integral_constant<Layout, Layout::kQ4>{});
    case Layout::kQ4Sym: return f(std::integral_constant<Layout, Layout::kQ4Sym>{});
    case Layout::kQ8: return f(std::integral_constant<Layout, Layout::kQ8>{});
    case Layout::kQ8Min: return f(std::integral_constant<Layout, Layout::kQ8Min>{});
    case Layout::kQ4K: return f(std::integral_constant<Layout, Layout::kQ4K>{});
    case Layout::kQ8K: return f(std::integral_constant<Layout, Layout::kQ8K>{});
    case Layout::kQ8K16: break;
  }
  return f(std::integral_constant<Layout, Layout::kQ8K16>{});
}

// One packed matrix, as the kernels read it.
struct PackedMatrix {
  const uint8_t* codes;
  int64_t group_bytes;  // codes per group of 16 rows
  const void* scales;   // (groups, K / scale weights, 16): fp16 d, or the 8-bit sub-block scales (k-quants)
  const void* offsets;  // (groups, K / 32, 16): fp16 m, or the 8-bit sub-block mins (k-quants); null: none
  const at::Half* super;  // (groups, K / 256, 2, 16): D and -Dmin (k-quants); else null
  int64_t K;
};

// d and m of the 16 rows of group G in scale block s, in fp32.
template <Layout L>
inline void block_scales(const PackedMatrix& w, int64_t G, int64_t s, float* d, float* m) {
  using T = Traits<L>;
  const int64_t at = (G * (w.K / T::kScaleWeights) + s) * kGroup;
  for (int v = 0; v < kGroup; v += simd::kWidth) {
    if constexpr (L == Layout::kQ4Sym) {
      const simd::Vec scale = simd::load(static_cast<const at::Half*>(w.scales) + at + v);
      simd::store(d + v, scale);
      simd::store(m + v, simd::mul(scale, simd::set1(-8.0f)));  // exact: a power of two
    } else if constexpr (!T::kSuper) {
      simd::store(d + v, simd::load(static_cast<const at::Half*>(w.scales) + at + v));
      if constexpr (T::kOffsets) simd::store(m + v, simd::load(static_cast<const at::Half*>(w.offsets) + at + v));
    } else {
      const at::Half* super = w.super + (G * (w.K / kSuperWeights) + s * T::kScaleWeights / kSuperWeights) * 2 * kGroup;
      const auto* sub = static_cast<const typename T::SubScale*>(w.scales) + at;
      simd::store(d + v, simd::mul(simd::load(super + v), simd::load(sub + v)));
      if constexpr (T::kOffsets) {
        const auto* mins = static_cast<const uint8_t*>(w.offsets) + at;
        simd::store(m + v, simd::mul(simd::load(super + kGroup + v), simd::load(mins + v)));
      }
    }
  }
}

// One scale block of one group as q[k][row] (k the weight's index in the block, row in the group): 4-bit
// codes 0..15, 8-bit codes -128..127. Byte i of chunk c is (half h, row r, element e) = (i / 32, i % 32 / 2,
// i % 2); 4-bit: its low nibble is weight 2(4c + h) + e, its high nibble weight 2(4c + 2 + h) + e; 8-bit: it
// is weight 2(2c + h) + e.
template <Layout L>
inline void unpack_block(const uint8_t* block, int16_t q[Traits<L>::kScaleWeights][kGroup]) {
  for (int c = 0; c < Traits<L>::kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 2; ++e) {
        const uint8_t* bytes = block + c * kChunkBytes + h * 32 + e;
        for (int r = 0; r < kGroup; ++r) {
          const uint8_t byte = bytes[2 * r];
          if constexpr (Traits<L>::kFourBit) {
            q[2 * (4 * c + h) + e][r] = byte & 0x0F;
            q[2 * (4 * c + 2 + h) + e][r] = byte >> 4;
          } else {
            q[2 * (2 * c + h) + e][r] = static_cast<int8_t>(byte);
          }
        }
      }
    }
  }
}

// Rows of x quantized per block of 32 to Code (int16_t: the few-row path; int8_t: --batch-activations
// int8), each block with scale d = max|x_b| / Code's largest value and its exact sum (the offset term).
template <typename Code>
struct QuantizedRows {
  std::vector<Code> codes;   // (M, K) round(x / d)
  std::vector<float> scales;  // (M, K / 32) d
  std::vector<float> sums;    // (M, K / 32) sum of x_b
};

// x: float or at::BFloat16 (a bf16 model's activations are read as they are, not copied to fp32 first).
template <typename Code, typename In>
QuantizedRows<Code> quantize_rows(const In* x, int64_t M, int64_t K) {
  constexpr float kLevels = static_cast<float>(std::numeric_limits<Code>::max());
  const int64_t num_blocks = K / kBlock;
  QuantizedRows<Code> q{std::vector<Code>(M * K), std::vector<float>(M * num_blocks), std::vector<float>(M * num_blocks)};
  for (int64_t i = 0; i < M * num_blocks; ++i) {
    float xb[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) xb[j] = to_float(x[i * kBlock + j]);
    float amax = 0.0f, sum = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      sum += xb[j];
    }
    const float inv = amax > 0.0f ? kLevels / amax : 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) q.codes[i * kBlock + j] = static_cast<Code>(std::nearbyint(xb[j] * inv));
    q.scales[i] = amax / kLevels;
    q.sums[i] = sum;
  }
  return q;
}

// out[m, 16 G + n] = sum_k x[m, k] w[16 G + n, k] for every group G and row m, with w dequantized in fp32
// (exactly the file's weights). out has out_stride floats a row.
void matmul_dequantized_tiles(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                              float* out, int64_t out_stride);

// The same with bf16 x and the weights rounded to bf16 in registers (VDPBF16PS), where this build has
// AVX512-BF16: what a dense bf16 copy of the matrix would compute, without the copy.
bool has_bf16_tiles();
void matmul_bf16_tiles(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                       float* out, int64_t out_stride);

// The same with x rounded to int8 per block of 32 (quantized_int8.cpp): twice the products an instruction,
// where this build has it for the layout (AVX2's VPMADDUBSW, 4-bit codes). Opt-in: --batch-activations int8.
bool has_int8_rows(Layout layout);
void matmul_int8_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                      int64_t out_stride);

}  // namespace serval_kernels::quantized
