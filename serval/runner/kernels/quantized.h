// The packed low-bit weight layouts shared by quantized_linear.cpp (int16 x: integer dot products) and
// quantized_int8.cpp (int8 x). The byte layout of the
// codes is described below and in quantized_linear.cpp; serval/runner/quantization.py and gguf_repack.cpp
// write them.
//
// Every layout stores codes in groups of 16 output rows, and for each row and scale block of 16 or 32
// weights a scale d and, where the format has one, an offset m: w = d q + m. Codes are 4-bit (nibbles), 5-
// or 6-bit (nibbles plus a chunk of high bits), or int8, each at its file's width, so a matrix takes in
// memory what it takes in its file:
//   kQ4     4-bit codes, fp16 d and m per 32 (GGUF Q4_1)
//   kQ4Sym  4-bit codes, fp16 d per 32, m = -8 d (Q4_0: w = d (q - 8))
//   kQ8     int8 codes, fp16 d per 32, no m (Q8_0)
//   kQ5Sym  5-bit codes, fp16 d per 32, w = d (q - 16) (Q5_0)
//   kQ5     5-bit codes, fp16 d and m per 32 (Q5_1)
//   kQ4K    4-bit codes; per 256 an fp16 d and -dmin, per 32 a 6-bit scale and min: d = D sc, m = -Dmin mn
//           (Q4_K)
//   kQ5K    the same with 5-bit codes (Q5_K)
//   kQ6K    6-bit codes, per 256 an fp16 D, per 16 an int8 scale: d = D sc, w = d (q - 32) (Q6_K)
//   kMXFP4  4-bit E2M1 codes, per 32 an E8M0 exponent byte e: w = v[q] 2^(e - 128) (MXFP4), v the int8
//           table kMxfp4Values (the E2M1 values doubled, as ggml halves the scale), looked up as the codes are
//           widened; the scale stays its exponent byte (2^-127 .. 2^127 is past fp16's range)
// d and m are formed in fp32 exactly as ggml's dequantizers form them, so w is the file's weight bit for bit.
//
// A scale block's codes are 64-byte chunks. Byte i of a chunk is (half h, row r, element e) = (i / 32,
// i % 32 / 2, i % 2). 4-, 5- and 6-bit layouts start with nibble chunks: chunk c's low nibble is weight
// 2(4c + h) + e, its high nibble weight 2(4c + 2 + h) + e (nibble n of chunk c: weight 8c + 4n + 2h + e).
// 5- and 6-bit layouts end each scale block with one chunk of high bits, byte i again (h, r, e): bits
// H(2c + n) .. H(2c + n) + H - 1 are the high H bits (H = 1 or 2) of nibble n of chunk c. (A 5-bit scale
// block is 32 weights: 4 nibble chunks and 32 x 16 high bits; a 6-bit one 16: 2 nibble chunks and 16 x 16 x 2.)
// An int8 chunk c's byte is weight 2(2c + h) + e.
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
constexpr int64_t kFewRows = 8;  // up to this many rows of x a matmul is a decode step's: the few-row paths
// How far ahead of its use a group's codes are asked for by the few-row kernels. The codes of consecutive
// groups are consecutive, so this runs on into the next group a thread takes (or past the end: a prefetch
// never faults). The hardware prefetchers alone read 18.7 GB/s on one core for a batch-1 decode's 120
// matmuls (73 MB), with this 8 KB 24-26 GB/s (2 KB: 21, 4 KB: 24, 16 KB: 25; scales and offsets prefetched
// too: no better).
constexpr int64_t kPrefetchBytes = 8192;

enum class Layout { kQ4, kQ4Sym, kQ8, kQ5Sym, kQ5, kQ4K, kQ5K, kQ6K, kMXFP4 };

// MXFP4's E2M1 codes as integers: each FP4 value doubled (ggml's kvalues_mxfp4), the scale halved to match.
alignas(16) constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 exponent byte as ggml's GGML_E8M0_TO_FP32_HALF reads it, 2^(e - 128) in fp32 exactly: the
// exponent field e - 1, or for e 0 and 1 the subnormals 2^-128 and 2^-127.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// e8m0_half of 16 exponent bytes (a group's rows) into d: the same bits, built 8 or 16 lanes at a time. (With
// the scalar loop a one-row MXFP4 matmul took twice Q4_0's time on AVX2: 4096 x 4096, one thread, 2.0 ms
// against 1.0 with these.)
inline void e8m0_half_rows(const uint8_t* e, float* d) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
  const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
  const __mmask16 small = _mm512_cmplt_epi32_mask(v, _mm512_set1_epi32(2));
  _mm512_storeu_si512(d, _mm512_mask_blend_epi32(small, normal, subnormal));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + 8 * h)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 8 * h), _mm256_blendv_epi8(normal, subnormal, small));
  }
#else
  for (int r = 0; r < kGroup; ++r) d[r] = e8m0_half(e[r]);
#endif
}

template <Layout L>
struct Traits {
  static constexpr int kCodeBits = L == Layout::kQ8 ? 8 : (L == Layout::kQ6K ? 6 : (L == Layout::kQ5Sym || L == Layout::kQ5 || L == Layout::kQ5K ? 5 : 4));
  static constexpr bool kNibbles = kCodeBits < 8;  // 4-bit codes, or nibbles plus high bits
  static constexpr int kHighBits = kNibbles ? kCodeBits - 4 : 0;
  static constexpr bool kSuper = L == Layout::kQ4K || L == Layout::kQ5K || L == Layout::kQ6K;
  // Whether y gets the offset term m sum(x_b). Q4_0's m = -8 d is one; Q5_0's and Q6_K's bias is subtracted
  // from the codes instead (Q6_K's d changes every 16 weights, x's sums are per 32).
  static constexpr bool kOffsets =
      L != Layout::kQ8 && L != Layout::kQ5Sym && L != Layout::kQ6K && L != Layout::kMXFP4;
  static constexpr int kCodeBias = L == Layout::kQ5Sym ? 16 : (L == Layout::kQ6K ? 32 : 0);
  // Whether a nibble is an index into kMxfp4Values (MXFP4) rather than the code itself.
  static constexpr bool kCodeTable = L == Layout::kMXFP4;
  // once the bias is subtracted or the table looked up
  static constexpr bool kSignedCodes = L == Layout::kQ8 || kCodeBias != 0 || kCodeTable;
  static constexpr int64_t kScaleWeights = L == Layout::kQ6K ? 16 : 32;  // weights per d (and m)
  static constexpr int kNibbleChunks = kNibbles ? static_cast<int>(kScaleWeights / 8) : 0;
  static constexpr int kChunks = kNibbles ? kNibbleChunks + (kHighBits > 0) : static_cast<int>(kScaleWeights / 4);  // 64-byte chunks per d
  using SubScale = std::conditional_t<L == Layout::kQ6K, int8_t, uint8_t>;
};

// 64-byte chunks per 32 weights of a group (the codes tensor's third dimension): 4, 5, 6 or 8.
constexpr int64_t chunks_per_block(int code_bits) { return code_bits == 8 ? 8 : code_bits; }

// f(std::integral_constant<Layout, L>{}) for the layout known at run time: the one switch from a matrix's
// layout to a kernel compiled for it.
template <typename F>
decltype(auto) with_layout(Layout layout, F&& f) {
  switch (layout) {
    case Layout::kQ4: return f(std::integral_constant<Layout, Layout::kQ4>{});
    case Layout::kQ4Sym: return f(std::integral_constant<Layout, Layout::kQ4Sym>{});
    case Layout::kQ8: return f(std::integral_constant<Layout, Layout::kQ8>{});
    case Layout::kQ5Sym: return f(std::integral_constant<Layout, Layout::kQ5Sym>{});
    case Layout::kQ5: return f(std::integral_constant<Layout, Layout::kQ5>{});
    case Layout::kQ4K: return f(std::integral_constant<Layout, Layout::kQ4K>{});
    case Layout::kQ5K: return f(std::integral_constant<Layout, Layout::kQ5K>{});
    case Layout::kQ6K: return f(std::integral_constant<Layout, Layout::kQ6K>{});
    case Layout::kMXFP4: break;
  }
  return f(std::integral_constant<Layout, Layout::kMXFP4>{});
}

// One packed matrix, as the kernels read it.
struct PackedMatrix {
  const uint8_t* codes;
  int64_t group_bytes;  // codes per group of 16 rows
  // (groups, K / scale weights, 16): fp16 d, or the 8-bit sub-block scales (k-quants), or E8M0 bytes (MXFP4)
  const void* scales;
  const void* offsets;  // (groups, K / 32, 16): fp16 m, or the 8-bit sub-block mins (k-quants); null: none
  const at::Half* super;  // (groups, K / 256, 2, 16): D and -Dmin (k-quants); else null
  int64_t K;
};

// d and m of the 16 rows of group G in scale block s, in fp32. Inlined always: called apart (GCC's choice once
// its AVX2 int8 caller grew), it took a quarter of a Q4_K decode's time (AMD family 25).
template <Layout L>
[[gnu::always_inline]] inline void block_scales(const PackedMatrix& w, int64_t G, int64_t s, float* d, float* m) {
  using T = Traits<L>;
  const int64_t at = (G * (w.K / T::kScaleWeights) + s) * kGroup;
  if constexpr (L == Layout::kMXFP4) {  // no offset: w = v[q] d
    e8m0_half_rows(static_cast<const uint8_t*>(w.scales) + at, d);
    (void)m;
    return;
  }
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

// One scale block of one group as q[k][row] (k the weight's index in the block, row in the group): the codes
// less the layout's bias (the byte layout is at the top of this file).
template <Layout L>
inline void unpack_block(const uint8_t* block, int16_t q[Traits<L>::kScaleWeights][kGroup]) {
  using T = Traits<L>;
  for (int h = 0; h < 2; ++h) {
    for (int e = 0; e < 2; ++e) {
      for (int r = 0; r < kGroup; ++r) {
        const int at = h * 32 + 2 * r + e;
        if constexpr (T::kNibbles) {
          const uint8_t high = T::kHighBits ? block[T::kNibbleChunks * kChunkBytes + at] : 0;
          for (int c = 0; c < T::kNibbleChunks; ++c) {
            const uint8_t byte = block[c * kChunkBytes + at];
            for (int n = 0; n < 2; ++n) {
              const int nibble = n ? byte >> 4 : byte & 0x0F;
              const int top = (high >> (T::kHighBits * (2 * c + n))) & ((1 << T::kHighBits) - 1);
              const int code = T::kCodeTable ? kMxfp4Values[nibble] : (nibble | (top << 4)) - T::kCodeBias;
              q[8 * c + 4 * n + 2 * h + e][r] = static_cast<int16_t>(code);
            }
          }
        } else {
          for (int c = 0; c < T::kChunks; ++c) q[2 * (2 * c + h) + e][r] = static_cast<int8_t>(block[c * kChunkBytes + at]);
        }
      }
    }
  }
}

// The codes of one 32-byte half of nibble chunk c, its low (n = 0) or high (n = 1) nibbles, in bytes: the
// nibbles joined with their high bits from `high`, the same half of the scale block's high-bit chunk, less
// the layout's bias, or for MXFP4 looked up in kMxfp4Values (a byte shuffle: the nibble indexes the table in
// each 128-bit lane) (signed bytes where Traits::kSignedCodes). AVX2's and AVX-512's 256-bit halves.
#if defined(__AVX2__)
template <Layout L>
inline __m256i nibble_codes(__m256i nibbles, __m256i high, int c, int n) {
  using T = Traits<L>;
  __m256i q = _mm256_and_si256(n ? _mm256_srli_epi16(nibbles, 4) : nibbles, _mm256_set1_epi8(0x0F));
  if constexpr (T::kHighBits > 0) {
    // The bits H(2c + n).. of each byte to bits 4.. of the same byte (a 16-bit shift of at most 4 left or 3
    // right never brings a neighbour's bit into the bits kept).
    const int at = T::kHighBits * (2 * c + n);
    const __m256i moved = at <= 4 ? _mm256_slli_epi16(high, 4 - at) : _mm256_srli_epi16(high, at - 4);
    q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(((1 << T::kHighBits) - 1) << 4))));
  }
  if constexpr (T::kCodeBias != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(T::kCodeBias));
  if constexpr (T::kCodeTable) {
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), q);
  }
  return q;
}
#endif
#if defined(__AVX512BW__)
template <Layout L>
inline __m512i nibble_codes(__m512i nibbles, __m512i high, int c, int n) {
  using T = Traits<L>;
  __m512i q = _mm512_and_si512(n ? _mm512_srli_epi16(nibbles, 4) : nibbles, _mm512_set1_epi8(0x0F));
  if constexpr (T::kHighBits > 0) {
    const int at = T::kHighBits * (2 * c + n);
    const __m512i moved = at <= 4 ? _mm512_slli_epi16(high, 4 - at) : _mm512_srli_epi16(high, at - 4);
    // q | (moved & mask) in one instruction: truth table of (a, b, c) = (q, moved, mask) is a | (b & c).
    q = _mm512_ternarylogic_epi32(q, moved, _mm512_set1_epi8(static_cast<char>(((1 << T::kHighBits) - 1) << 4)), 0xF8);
  }
  if constexpr (T::kCodeBias != 0) q = _mm512_sub_epi8(q, _mm512_set1_epi8(T::kCodeBias));
  if constexpr (T::kCodeTable) {
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), q);
  }
  return q;
}
#endif

// Rows of x quantized per block of 32 to Code (int16_t: the few-row path; int8_t: --batch-activations
// int8), each block with scale d = max|x_b| / Code's largest value and the sum of its rounded values, for
// the offset term: y_b = d_w dot(q, x_b) + m sum(x_b) is then exactly the product of the file's weights
// (d_w q + m) with the rounded x, whose error is the rounding times those weights. With the exact sum of
// x_b instead, the error is the rounding times d_w q alone: for Q4_1, whose q is 0..15 and m the block's
// minimum, weights shifted all one way, which measured 1.5-3x the error per matmul with int8 x (the
// default model's prefill) and 3x llama.cpp's divergence from fp32 (docs/benchmarks.md).
template <typename Code>
struct QuantizedRows {
  std::vector<Code> codes;   // (M, K) round(x / d)
  std::vector<float> scales;  // (M, K / 32) d
  std::vector<float> sums;    // (M, K / 32) d * sum of codes: the sum of the rounded x_b
};

// One block of 32 values (widened to fp32 vectors) rounded to Code: its codes, d and d * the sum of its codes.
// Vector rounds and narrowing (round_nearest is nearbyint's round-half-even): the bits a scalar loop gives.
// With split_for_int8's outlier test in vectors too, a 64-row int8 matmul of 576 x 576 went from 0.070-0.072
// to 0.063 ms, one of 576 x 1536 from 0.153 to 0.134 (AMD family 26, alternating builds): the scalar test
// and narrowing had taken a third of the smaller one's time (`perf`).
template <typename Code>
inline void quantize_block(const simd::Vec* v, Code* codes, float* scale, float* sum) {
  constexpr float kLevels = static_cast<float>(std::numeric_limits<Code>::max());
  constexpr int W = simd::kWidth, V = kBlock / W;
  simd::Vec amax_v = simd::zero();
  for (int i = 0; i < V; ++i) amax_v = simd::max(amax_v, simd::max(v[i], simd::sub(simd::zero(), v[i])));
  const float amax = simd::reduce_max(amax_v);
  const simd::Vec inv = simd::set1(amax > 0.0f ? kLevels / amax : 0.0f);
  int32_t code_sum = 0;  // at most 32 x 32767: no overflow
  for (int i = 0; i < V; ++i) code_sum += simd::store_whole(simd::round_nearest(simd::mul(v[i], inv)), codes + W * i);
  *scale = amax / kLevels;
  *sum = *scale * static_cast<float>(code_sum);
}
template <typename Code>
inline void quantize_block(const float* xb, Code* codes, float* scale, float* sum) {
  simd::Vec v[kBlock / simd::kWidth];
  for (int i = 0; i < kBlock / simd::kWidth; ++i) v[i] = simd::load(xb + simd::kWidth * i);
  quantize_block(v, codes, scale, sum);
}

// Blocks a thread rounds at a time: one call's x is rounded on every thread. Done on one, it took 5-10% of a
// 512-row prefill matmul of the default model (the other thread waiting) and most of the int8 path's time
// at 64 rows (AMD family 26, `perf`); a decode's few blocks stay on the calling thread.
constexpr int64_t kQuantizeGrain = 64;

// x: float or at::BFloat16 (a bf16 model's activations are read as they are, not copied to fp32 first).
template <typename Code, typename In>
QuantizedRows<Code> quantize_rows(const In* x, int64_t M, int64_t K) {
  const int64_t num_blocks = K / kBlock;
  QuantizedRows<Code> q{std::vector<Code>(M * K), std::vector<float>(M * num_blocks), std::vector<float>(M * num_blocks)};
  parallel_chunks(M * num_blocks, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    alignas(64) float xb[kBlock];
    for (int64_t i = begin; i < end; ++i) {
      load_row(x + i * kBlock, xb, kBlock);
      quantize_block(xb, q.codes.data() + i * kBlock, &q.scales[i], &q.sums[i]);
    }
  });
  return q;
}

// out[m, 16 G + n] = sum_k x[m, k] w[16 G + n, k] with x rounded to int8 per block of 32 (quantized_int8.cpp):
// twice the products an instruction, where this build has it for the layout (4-bit codes; VPDPBUSD, or AVX2's
// VPMADDUBSW). The default at every row count; --batch-activations float32 turns it off.
bool has_int8_rows(Layout layout);
// Where a bf16 model's matmul puts its result group by group instead of in the fp32 `out`: each group's 16
// columns are summed in a small fp32 tile of the thread that computes them (in L1: a 64-row step's fp32
// result, 0.8 MB for a 3072-wide matmul, is never written, and the matmul costs 2-3% less), then rounded to bf16
// as c10 rounds and stored to bf16 (M, N), or added to residual (M, N) fp32: a residual stream's x.add_(y) of
// the bf16 y, the same bits, with neither y nor a separate pass (both null: the fp32 `out`, all of it). Before
// the tile, a separate pass over out took 1.3-1.8% of a 64-row decode step and a fork and join of the threads
// per matmul; quantized_linear.cpp keeps out for results too large for L1-sized columns (below).
// With swiglu, the matmul is a SwiGLU MLP's gate_up (gate's N columns, then up's N: whole groups each) and bf16
// (M, N) takes silu(gate) * up of their bf16 values (common.h's silu_mul_span, silu_mul's bits): each thread
// computes a gate group and its up group, and neither the 2N-wide result nor a pass over it is made.
struct GroupOutput {
  at::BFloat16* bf16 = nullptr;
  float* residual = nullptr;
  int64_t N = 0;
  bool swiglu = false;
  bool by_group() const { return bf16 != nullptr || residual != nullptr; }
};
void matmul_int8_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                      int64_t out_stride, GroupOutput to = {});
// bf16 x (a bf16 model's activations) read as they are, widened a block at a time.
void matmul_int8_rows(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                      float* out, int64_t out_stride, GroupOutput to = {});

// Whether a tensor holds values (an absent offsets or super-scales tensor is empty or undefined).
bool present(const at::Tensor& t);

// The layout of a packed matrix from its tensors, each checked against x's width K (quantized_linear.cpp).
Layout packed_layout(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                     const at::Tensor& super, int64_t K);

// out = x @ w.T through the int16 products (x rounded to int16 per block: quantized_linear.cpp).
void matmul_int16_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                       int64_t out_stride);
void matmul_int16_rows(const at::BFloat16* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups,
                       float* out, int64_t out_stride);

// out = x @ w.T for M rows of fp32 x, the path chosen as quantized_linear chooses it for fp32 x: int8 x where
// asked and the build has it for the layout, int16 x up to 16 rows, else the fp32 tiles (quantized_linear.cpp).
// Called inside a parallel region (kernels/moe.cpp) it runs on the calling thread alone.
void matmul_packed_rows(const float* x, int64_t M, const PackedMatrix& w, Layout layout, int64_t num_groups, float* out,
                        int64_t out_stride, bool int8_batch_activations);

}  // namespace serval_kernels::quantized
