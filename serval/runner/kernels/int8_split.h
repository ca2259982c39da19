// x rounded to int8 for quantized_int8.cpp's products, and the exact products of what it leaves out: per row,
// its outliers (below) come out of the rounding, and each block of 32 is rounded to 1/127 of its largest
// value with its code sum (quantized.h's quantize_block, as the int16 path rounds). A row's numbers are its
// own whatever rows share the call (batch invariance), and every thread takes rows.
#pragma once
#include <algorithm>
#include <vector>

#include "quantized.h"

namespace serval_kernels::quantized {

// Outliers. Some models' activations hold values tens of times larger than the rest of their row (SmolLM2's
// do, in a few channels); rounded to int8 with its block, such a value leaves the block's other 31 a level or
// two each, which flipped most greedy answers of the default model within 32 tokens. A value past
// kOutlierRatio times its row's RMS is therefore taken out of the int8 rows and multiplied exactly, its
// column's weights dequantized a group at a time: ~90 values a matmul of a 128-row prefill of the default
// model, ~60 of a random-weight 1B. (At 6x the default model's fidelity was better still, but the random
// 1B's heavy-tailed SwiGLU outputs gave ~480 columns a matmul, and its prefill took 30-40% longer.)
constexpr float kOutlierRatio = 10.0f;

struct Outlier {
  int64_t column, row;
  float value;
};

// x's outliers (ordered by column, so each column's weights are dequantized once a group), and the rest of
// x rounded to int8 per block with the outliers taken as 0.
struct Int8Split {
  std::vector<Outlier> outliers;
  QuantizedRows<int8_t> rows;
};

// Per row, in parallel: its mean square (a vector sum in a fixed order: the bound is the row's alone), its
// outliers, and its blocks rounded with the outliers taken as 0. Done on one thread this took as long as
// the int8 products themselves at 64-512 rows (AMD family 26, `perf`). kPlus128: each code is stored as
// code + 128 (its sign bit flipped), VPDPBUSD's unsigned operand for Q8_0's signed weights
// (quantized_int8.cpp's group_pass_q8), while the block is still in L1.
template <bool kPlus128 = false, typename In>
Int8Split split_for_int8(const In* x, int64_t M, int64_t K) {
  const int64_t num_blocks = K / kBlock;
  QuantizedRows<int8_t> rows{std::vector<int8_t>(M * K), std::vector<float>(M * num_blocks),
                             std::vector<float>(M * num_blocks)};
  std::vector<std::vector<Outlier>> row_outliers(M);
  parallel_chunks(M, std::max<int64_t>(1, kQuantizeGrain / num_blocks), [&](int64_t begin, int64_t end) {
    constexpr int W = simd::kWidth, V = kBlock / W;
    alignas(64) float xb[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const In* row = x + r * K;
      const float bound = kOutlierRatio * kOutlierRatio * dot(row, row, K) / static_cast<float>(K);
      const simd::Vec bound_v = simd::set1(bound);
      for (int64_t s = 0; s < num_blocks; ++s) {
        simd::Vec v[V];
        bool any = false;
        for (int i = 0; i < V; ++i) {
          v[i] = simd::load(row + s * kBlock + W * i);
          any |= simd::any_greater(simd::mul(v[i], v[i]), bound_v);
        }
        if (any) {  // rare: a few values a matmul
          for (int i = 0; i < V; ++i) simd::store(xb + W * i, v[i]);
          for (int64_t j = 0; j < kBlock; ++j) {
            if (xb[j] * xb[j] > bound) {
              row_outliers[r].push_back({s * kBlock + j, r, xb[j]});
              xb[j] = 0.0f;
            }
          }
          for (int i = 0; i < V; ++i) v[i] = simd::load(xb + W * i);
        }
        const int64_t i = r * num_blocks + s;
        int8_t* codes = rows.codes.data() + i * kBlock;
        quantize_block(v, codes, &rows.scales[i], &rows.sums[i]);
        if constexpr (kPlus128)
          for (int64_t j = 0; j < kBlock; ++j) codes[j] = static_cast<int8_t>(codes[j] ^ 0x80);
      }
    }
  });
  std::vector<Outlier> outliers;
  for (const auto& found : row_outliers) outliers.insert(outliers.end(), found.begin(), found.end());
  // By column, so that each column's weights are dequantized once a group; a row's outliers keep their order.
  std::stable_sort(outliers.begin(), outliers.end(), [](const Outlier& a, const Outlier& b) { return a.column < b.column; });
  return {std::move(outliers), std::move(rows)};
}

// Weight k of group G's 16 rows, as the file holds it: w = d q + m (byte layout in quantized.h: in the 4-bit
// and 6-bit layouts weight 8c + 4n + 2h + e of a scale block is nibble n of byte (h, r, e) of chunk c, with
// Q6_K's high bits in its last chunk; in Q8_0's, weight 4c + 2h + e is byte (h, r, e) of chunk c, and w = d q).
template <Layout L>
inline void column_weights(const PackedMatrix& w, int64_t G, int64_t k, float* out) {
  alignas(64) float d[kGroup], m[kGroup];
  if constexpr (L == Layout::kQ8) {
    const int64_t s = k / kBlock, i = k % kBlock;
    block_scales<L>(w, G, s, d, m);
    const int c = static_cast<int>(i / 4), h = static_cast<int>(i % 4 / 2), e = static_cast<int>(i % 2);
    const auto* bytes = reinterpret_cast<const int8_t*>(w.codes + G * w.group_bytes +
                                                        s * Traits<L>::kChunks * kChunkBytes + c * kChunkBytes) + h * 32 + e;
    for (int r = 0; r < kGroup; ++r) out[r] = d[r] * static_cast<float>(bytes[2 * r]);
    return;
  }
  using T = Traits<L>;
  // Q6_K's scale blocks are 16 weights, each ending in its high bits (quantized.h).
  const int64_t b = k / T::kScaleWeights, j = k % T::kScaleWeights;
  block_scales<L>(w, G, b, d, m);
  if constexpr (!T::kOffsets) std::fill_n(m, kGroup, 0.0f);  // w = v[q] d (MXFP4), d (q - 32) (Q6_K)
  const int c = static_cast<int>(j / 8), n = static_cast<int>(j % 8 / 4), h = static_cast<int>(j % 4 / 2),
            e = static_cast<int>(j % 2);
  const uint8_t* block = w.codes + G * w.group_bytes + b * T::kChunks * kChunkBytes;
  const uint8_t* bytes = block + c * kChunkBytes + h * 32 + e;
  const uint8_t* high = block + T::kNibbleChunks * kChunkBytes + h * 32 + e;
  for (int r = 0; r < kGroup; ++r) {
    const int nibble = (bytes[2 * r] >> (4 * n)) & 0x0F;
    const int top = T::kHighBits ? (high[2 * r] >> (T::kHighBits * (2 * c + n))) & ((1 << T::kHighBits) - 1) : 0;
    const int code = T::kCodeTable ? kMxfp4Values[nibble] : (nibble | (top << 4)) - T::kCodeBias;
    out[r] = d[r] * static_cast<float>(code) + m[r];
  }
}

// y[r][n] += the outliers' exact products with group G's 16 rows (y: the group's first column of row 0, rows
// out_stride apart), in vectors (one FMA a value: the bits of the scalar loop, which the compiler had left
// scalar and took 4% of a 64-row decode step).
template <Layout L>
void add_outlier_products(const PackedMatrix& w, int64_t G, const std::vector<Outlier>& outliers, float* out,
                          int64_t out_stride) {
  alignas(64) float weights[kGroup];
  int64_t column = -1;
  for (const Outlier& o : outliers) {
    if (o.column != column) column_weights<L>(w, G, column = o.column, weights);
    float* y = out + o.row * out_stride;
    const simd::Vec value = simd::set1(o.value);
    for (int r = 0; r < kGroup; r += simd::kWidth)
      simd::store(y + r, simd::fmadd(value, simd::load(weights + r), simd::load(y + r)));
  }
}

}  // namespace serval_kernels::quantized
