// y = x @ W.T for dense weights (fp32, bf16 or f16, as loaded) with every output summed over K in one order,
// whatever the number of rows: a row's bits depend only on that row and W (batch invariance,
// docs/architecture.md). PyTorch's GEMMs pick their blocking of K by the shape (oneDNN, MKL), so a token's
// logits moved with the number of tokens in its step; this kernel's order is fixed by K alone.
//
// The order, for output (m, n): one vector accumulator, lane i summing the products of k = i, i + kStep, ...
// in increasing k (kStep: the vector width, or 32 bf16 pairs with AVX512-BF16's VDPBF16PS), a last step over
// the zero-padded tail of K, then the lanes summed by simd::reduce_add. Blocking over rows and output columns
// only chooses which (m, n) are computed together (a tile of R rows x C columns whose accumulators stay in
// registers), never how one is summed, so 1 row and 512 rows take the same code per element.
#include "common.h"

using namespace serval_kernels;

namespace {

#if defined(__AVX512F__)
constexpr int kTileRows = 4, kTileCols = 6;  // 24 accumulators of 32 registers
constexpr int kFewRows = 8;
#else
constexpr int kTileRows = 2, kTileCols = 4;  // 8 of 16
constexpr int kFewRows = 4;
#endif
constexpr int kAccumulators = kTileRows * kTileCols;
// Up to kFewRows rows of x (a speculative check's k + 1 rows, a few streams) go in one tile of fewer columns, so
// that each widened vector of W serves every row, and each tile asks for the next tile's rows of W as it reads
// its own: with a few rows of arithmetic a vector of W, the reads of W stalled, the hardware prefetchers not
// keeping up with C rows read side by side. The 135M model's layers, bf16 x, 2 threads, AMD family 26, ms:
// F16 W 1 row 6.5-6.9 -> 4.4-5.8, 5 rows 7.4-8.3 -> 5.4-5.7, 16 rows 16.5-17.9 -> 11.0-13.5; BF16 W 5 rows
// 6.7-7.6 -> 4.9-5.9, 16 rows 11.9-12.5 -> 7.3-8.2; 64 and 256 rows within the noise.
constexpr int tile_cols_for(int rows) { return std::max(1, std::min(kTileCols, kAccumulators / rows)); }
constexpr int64_t kRowBlock = 64;  // rows of x sharing one pass over a block of W's rows (its block in L2)
constexpr int64_t kDepth = 2048;  // elements of K per pass over a task's tiles (a multiple of every kStep)

// How each type enters the sum: a vector of fp32 from kWidth elements (simd::load widens bf16 and f16), and
// with bf16 x and W on AVX512-BF16 one VDPBF16PS over 32 pairs (each lane: its two products added to it).
template <typename X, typename W>
struct Products {
  static constexpr int64_t kStep = simd::kWidth;
  using Acc = simd::Vec;
  static Acc zero() { return simd::zero(); }
  static Acc add(Acc acc, const W* w, const X* x) { return simd::fmadd(simd::load(w), simd::load(x), acc); }
  static float sum(Acc acc) { return simd::reduce_add(acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Products<at::BFloat16, at::BFloat16> {
  static constexpr int64_t kStep = 32;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc acc, const at::BFloat16* w, const at::BFloat16* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
  }
  static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

// The last K % kStep elements of a row, zero-padded to a whole step (zeros add nothing to any lane).
template <typename T, int64_t kStep>
struct Tail {
  T values[kStep];
  Tail(const T* row, int64_t count) {
    std::memset(values, 0, sizeof(values));
    std::memcpy(values, row, count * sizeof(T));
  }
};

// The products of k in [k0, k1) (whole steps; with the tail of K when `last`) added to the R x C accumulators of
// one tile: from zero when `first`, else from `state`, where they are left unless `last`; when `last`,
// out[r * N + c] = the sum of (x[r], w[c]) in the order above. A pass over part of K and a pass over all of it
// add the same products to the same lanes in the same order: storing an accumulator between passes is exact.
template <typename X, typename W, int R, int C>
void tile(const X* x, const W* w, int64_t K, int64_t k0, int64_t k1, bool first, bool last,
          typename Products<X, W>::Acc* state, float* out, int64_t N) {
  using P = Products<X, W>;
  typename P::Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = first ? P::zero() : state[r * C + c];
  for (int64_t k = k0; k < k1; k += P::kStep) {
    for (int c = 0; c < C; ++c) simd::prefetch(w + (c + C) * K + k);  // the next tile's W (see kFewRows)
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[r][c] = P::add(acc[r][c], w + c * K + k, x + r * K + k);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) state[r * C + c] = acc[r][c];
    return;
  }
  if (k1 < K) {
    for (int r = 0; r < R; ++r) {
      const Tail<X, P::kStep> xt(x + r * K + k1, K - k1);
      for (int c = 0; c < C; ++c) {
        const Tail<W, P::kStep> wt(w + c * K + k1, K - k1);
        acc[r][c] = P::add(acc[r][c], wt.values, xt.values);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = P::sum(acc[r][c]);
}

template <typename X, typename W>
using Tile = void (*)(const X*, const W*, int64_t, int64_t, int64_t, bool, bool, typename Products<X, W>::Acc*,
                      float*, int64_t);

template <typename X, typename W, int R>
Tile<X, W> tile_for_cols(int64_t cols) {
  return with_row_count<tile_cols_for(R)>(cols, [](auto C) -> Tile<X, W> { return tile<X, W, R, C.value>; });
}

template <typename X, typename W>
Tile<X, W> tile_for(int64_t rows, int64_t cols) {
  return with_row_count<kFewRows>(rows, [cols](auto R) -> Tile<X, W> { return tile_for_cols<X, W, R.value>(cols); });
}

// Every (row block, column block) of the output is one task, column blocks outermost so a thread's run of
// tasks keeps its block of W in cache while x's row blocks pass. A task goes over K in passes of kDepth, each
// pass over all its tiles, so a tile's C rows of W stay in L1 while the row block's tiles use them (K = 8192
// in one pass: 4 rows of W and 4 of x from L2 at every step, 0.7x oneDNN's time at 64 rows).
// heads > 1: x (heads, M, K), w (heads, N, K) and out (heads, M, N), head h's product computed exactly as a call
// on that head alone; the tasks of all heads are handed out together (one parallel region, not one a head).
template <typename X, typename W>
void dense_matmul(const X* x, int64_t M, const W* w, int64_t N, int64_t K, float* out, int64_t heads = 1) {
  using P = Products<X, W>;
  const int64_t tile_rows = M <= kFewRows ? M : kTileRows, tile_cols = tile_cols_for(tile_rows);
  const int64_t col_block = (M <= kRowBlock ? 4 : 8) * kTileCols;  // a multiple of every tile_cols_for
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t col_blocks = (N + col_block - 1) / col_block;
  const int64_t whole = K - K % P::kStep;  // the rest: the zero-padded tail, in the last pass
  const int64_t passes = std::max<int64_t>(1, (whole + kDepth - 1) / kDepth);
  const int64_t head_tasks = row_blocks * col_blocks;
  parallel_chunks(heads * head_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<typename P::Acc> state(passes > 1 ? kRowBlock * col_block : 0);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t head = index / head_tasks, task = index % head_tasks;
      const X* xh = x + head * M * K;
      const W* wh = w + head * N * K;
      float* oh = out + head * M * N;
      const int64_t m0 = (task % row_blocks) * kRowBlock, n0 = (task / row_blocks) * col_block;
      const int64_t m1 = std::min(M, m0 + kRowBlock), n1 = std::min(N, n0 + col_block);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t k0 = pass * kDepth, k1 = std::min(whole, k0 + kDepth);
        auto* tile_state = state.data();
        for (int64_t n = n0; n < n1; n += tile_cols) {
          const int64_t cols = std::min<int64_t>(tile_cols, n1 - n);
          for (int64_t m = m0; m < m1; m += tile_rows) {
            const int64_t rows = std::min<int64_t>(tile_rows, m1 - m);
            tile_for<X, W>(rows, cols)(xh + m * K, wh + n * K, K, k0, k1, pass == 0, pass + 1 == passes,
                                       tile_state, oh + m * N + n, N);
            tile_state += kAccumulators;
          }
        }
      }
    }
  });
}

// fp32 x against W of any dtype (W widened to fp32 a vector at a time).
void dense_matmul_weights(const float* x, int64_t M, const at::Tensor& w, int64_t N, int64_t K, float* out,
                          int64_t heads) {
  switch (w.scalar_type()) {
    case at::kFloat: return dense_matmul(x, M, w.data_ptr<float>(), N, K, out, heads);
    case at::kBFloat16: return dense_matmul(x, M, w.data_ptr<at::BFloat16>(), N, K, out, heads);
    case at::kHalf: return dense_matmul(x, M, w.data_ptr<at::Half>(), N, K, out, heads);
    default: TORCH_CHECK(false, "dense_linear: weights must be float32, bfloat16 or float16");
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;  // bf16 x and W go through VDPBF16PS as they are
#else
constexpr bool kBf16Pairs = false;
#endif

}  // namespace

namespace {

// (heads, M, K) x and (heads, N, K) w -> (heads, M, N) in x's dtype.
at::Tensor dense_linear_of_heads(const at::Tensor& x, const at::Tensor& w) {
  const int64_t heads = x.size(0), M = x.size(1), K = x.size(2), N = w.size(1);
  const auto wc = w.contiguous();
  // bf16 x with bf16 W stays bf16 where VDPBF16PS takes the pairs; otherwise x is widened to fp32 once here
  // (exactly: the same products as widening it in every tile, which cost a conversion a vector of x a tile).
  const bool bf16_pairs = kBf16Pairs && x.scalar_type() == at::kBFloat16 && wc.scalar_type() == at::kBFloat16;
  const auto xc = bf16_pairs ? x.contiguous() : x.to(at::kFloat).contiguous();
  auto out = at::empty({heads, M, N}, xc.options().dtype(at::kFloat));
  if (heads > 0 && M > 0 && N > 0) {
    if (bf16_pairs) {
      dense_matmul(xc.data_ptr<at::BFloat16>(), M, wc.data_ptr<at::BFloat16>(), N, K, out.data_ptr<float>(), heads);
    } else {
      dense_matmul_weights(xc.data_ptr<float>(), M, wc, N, K, out.data_ptr<float>(), heads);
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

at::Tensor dense_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes must be (M, K) and (N, K)");
  return dense_linear_of_heads(x.unsqueeze(0), w.unsqueeze(0)).squeeze(0);
}

at::Tensor dense_linear_heads(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && x.size(0) == w.size(0) && x.size(2) == w.size(2),
              "shapes must be (heads, M, K) and (heads, N, K)");
  return dense_linear_of_heads(x, w);
}
