// Packed 4-bit weights times rows of x (prefill and decode steps, every row count) with int8 activations:
// unsigned 4-bit codes times signed 8-bit x; also Q8_0's int8 codes with AVX-512-VNNI, and the 5-bit layouts'
// (Q5_0, Q5_1, Q5_K) and Q6_K's codes on AVX2 (int8_rows_avx2.h). On AVX-512-VNNI, VPDPBUSD sums 4 products
// a row, 64 an instruction, against the int16 path's 32 (VPDPWSSD, quantized_linear.cpp); on AVX2,
// VPMADDUBSW makes 32 products an instruction, twice what VPMADDWD does on int16 x (quantized_linear.cpp,
// which serves the other layouts and the portable build). This is llama.cpp's trade: x rounds to 1/127 of its
// block's largest value (int16's 1/32767 stays with `--batch-activations float32`), which the throughput pays for;
// docs/benchmarks.md measures it.
// The default (`--batch-activations int8`; `float32` keeps int16 x): with outliers exact (below) and the
// offset term summing the rounded x (quantized.h), its divergence from fp32 on the default model is below
// llama.cpp's on the same file (docs/benchmarks.md). Q6_K's too: on a Q6_K file (SmolLM2-135M, AMD family 25)
// 0.0003 nats a token over fp32's top 100 tokens, llama-server 0.006 (its Q6_K products round x per 256).
//
// For one packed group (16 output rows), scale block s (32 weights) and a row of x, each output's block sum is
// an exact integer: y += d dx dot(q, xq) + m sum(x_b) in fp32, sum(x_b) of the rounded x (quantized.h says
// why). The AVX-512 passes are here; the AVX2 ones in int8_rows_avx2.h; MXFP4's signed codes and the block
// scales both take in int8_codes.h.
#include "int8_rows_amx.h"
#include "int8_rows_avx2.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

#if defined(__AVX512VNNI__)
constexpr int kPassRows = 8;  // rows of x per pass: their 16 sums and 16 outputs in registers

using Int8Rows = QuantizedRows<int8_t>;

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

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
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * Traits<L>::kChunks * kChunkBytes;
    __m512i chains[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < kChains; ++k) chains[r][k] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      __m512i low, high;
      nibble_row_quads<L>(block + c * kChunkBytes, low, high);
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
  const __m512i one_twenty_eight = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_blocks; ++s) {
    const uint8_t* block = w.codes + G * w.group_bytes + s * kChunks * kChunkBytes;
    __m512i chains[R][kChains], shift = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < kChains; ++k) chains[r][k] = _mm512_setzero_si512();
    for (int c = 0; c < kChunks; ++c) {
      simd::prefetch(block + c * kChunkBytes + kPrefetchBytes);
      const __m512i codes = int8_row_quads(block + c * kChunkBytes);
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
#if defined(SERVAL_HAS_AMX)
  // Whole tiles of 16 rows through AMX where it may be used (int8_rows_amx.h), the rows past them here.
  const int64_t tiled = M >= amx::kTileRows && amx::usable() ? M / amx::kTileRows * amx::kTileRows : 0;
  const amx::TileScales by_tile = tiled > 0 ? amx::tile_scales(xq, tiled, w.K / kBlock) : amx::TileScales{};
#else
  constexpr int64_t tiled = 0;
#endif
  // Runs of consecutive groups in guided shares (about 16 a call, as the int16 path's), so that each thread
  // streams consecutive codes: handed out one group at a time, the threads' interleaved groups made a
  // 16-row decode step 1.4x the int16 path's time (AMD family 26), the kernel alone being 0.7x.
  const auto fill = [&](int64_t G, float* y, int64_t stride) {
#if defined(SERVAL_HAS_AMX)
    if (tiled > 0) amx::group_tiles<L>(w, G, xq, by_tile, tiled, y, stride);
#endif
    for (int64_t r0 = tiled; r0 < M; r0 += kPassRows) (M - r0 >= kPassRows ? full : rest)(w, G, xq, r0, y, stride);
    add_outlier_products<L>(w, G, split.outliers, y, stride);
  };
#if defined(SERVAL_HAS_AMX)
  if (tiled > 0) {
    run_groups(M, num_groups, out, out_stride, to, /*fine=*/false, fill, [] { return amx::TileScope(); });
    return;
  }
#endif
  run_groups(M, num_groups, out, out_stride, to, /*fine=*/false, fill);
}
#elif defined(__AVX2__)
using avx2::matmul_impl;
#endif

}  // namespace

namespace serval_kernels::quantized {

bool has_int8_rows(Layout layout) {
#if defined(__AVX512VNNI__)
  return layout == Layout::kQ4 || layout == Layout::kQ4Sym || layout == Layout::kQ4K || layout == Layout::kMXFP4 ||
         layout == Layout::kQ8;
#elif defined(__AVX2__)
  return layout == Layout::kQ4 || layout == Layout::kQ4Sym || layout == Layout::kQ4K || layout == Layout::kMXFP4 ||
         layout == Layout::kQ5Sym || layout == Layout::kQ5 || layout == Layout::kQ5K || layout == Layout::kQ6K;
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
#else
    case Layout::kQ5Sym: matmul_impl<Layout::kQ5Sym>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kQ5: matmul_impl<Layout::kQ5>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kQ5K: matmul_impl<Layout::kQ5K>(x, M, w, num_groups, out, out_stride, to); break;
    case Layout::kQ6K: matmul_impl<Layout::kQ6K>(x, M, w, num_groups, out, out_stride, to); break;
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

int64_t int8_tile_rows() {
#if defined(SERVAL_HAS_AMX)
  return serval_kernels::quantized::amx::usable() ? serval_kernels::quantized::amx::kTileRows : 0;
#else
  return 0;
#endif
}
