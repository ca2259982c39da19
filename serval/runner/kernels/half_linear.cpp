// y = x @ W.T for W kept in 16-bit floats as the checkpoint stores them (GGUF F16 and BF16 matrices): the
// fp32 compute path's answer for those files, at 2 bytes a weight read instead of the 4 of a dense fp32 copy,
// and with no rounding of fp16 values to bf16 (fp16 keeps 3 more mantissa bits). Each weight is widened to
// fp32 in registers (F16C's VCVTPH2PS, or a 16-bit shift for bf16: simd::load) and multiplied in fp32, so the
// result is the dense fp32 matmul's up to summation order.
//
// Up to kMaxRows rows of x (decode) stream W once: each thread takes a run of output rows and keeps the dot
// products of one W row with every row of x in registers. More rows (prefill, large decode batches) are
// compute-bound: W is widened a panel of rows at a time into an fp32 buffer bounded in bytes and handed with x
// to PyTorch's fp32 GEMM, so no dense copy of the matrix ever exists. A bf16 model's larger batches stay in
// bf16 (oneDNN's bf16 GEMM, over the stored BF16 weights or a bounded panel of F16 ones rounded to bf16).
#include "common.h"

using namespace serval_kernels;

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPanelBytes = 4 << 20;  // fp32 widened weights per GEMM call (~ one core's L2 x 4)

// out[r * out_stride] = dot(w_row, x[r]) for R rows of x (K floats each). With one or two rows a single
// accumulator chain would wait on each FMA's latency, so the sum is split over independent chains.
template <typename W, int R>
void half_rows(const W* w_row, const float* x, int64_t K, float* out, int64_t out_stride) {
  constexpr int kChains = R == 1 ? 4 : (R == 2 ? 2 : 1);
  constexpr int64_t kStep = simd::kWidth * kChains;
  simd::Vec acc[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = simd::zero();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    for (int c = 0; c < kChains; ++c) {
      const simd::Vec w = simd::load(w_row + k + c * simd::kWidth);
      for (int r = 0; r < R; ++r) acc[r][c] = simd::fmadd(w, simd::load(x + r * K + k + c * simd::kWidth), acc[r][c]);
    }
  }
  for (; k < K; k += simd::kWidth) {  // K is a multiple of 32, so whole vectors remain
    const simd::Vec w = simd::load(w_row + k);
    for (int r = 0; r < R; ++r) acc[r][0] = simd::fmadd(w, simd::load(x + r * K + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    simd::Vec sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = simd::add(sum, acc[r][c]);
    out[r * out_stride] = simd::reduce_add(sum);
  }
}

template <typename W>
using HalfRows = void (*)(const W*, const float*, int64_t, float*, int64_t);

template <typename W>
HalfRows<W> half_rows_for(int64_t rows) {
  return with_row_count<kMaxRows>(rows, [](auto R) -> HalfRows<W> { return half_rows<W, R.value>; });
}

template <typename W>
void few_rows(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* out) {
  const HalfRows<W> run = half_rows_for<W>(M);
  parallel_chunks(N, std::max<int64_t>(N / 64, 16), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) run(w + n * K, x, K, out + n, N);
  });
}

template <typename W>
void widen_rows(const W* w, int64_t rows, int64_t K, float* out) {
  parallel_chunks(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) load_row(w + n * K, out + n * K, K);
  });
}

}  // namespace

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "x: (rows, K), w: (N, K)");
  TORCH_CHECK(w.size(0) == N && w.is_contiguous(), "w: (N, K) contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "K: a multiple of 32");
  const bool is_half = w.scalar_type() == at::kHalf;
  if (M > kMaxRows && x.scalar_type() == at::kBFloat16) {
    // A bf16 model (a CPU with native bf16 products) multiplies in bf16 through oneDNN, as it would over a
    // dense bf16 copy: BF16 weights as stored, F16 ones rounded to bf16 a bounded panel at a time.
    if (!is_half) return at::linear(x, w);
    const int64_t panel = std::min(N, std::max<int64_t>(64, kPanelBytes / (2 * K)));
    auto out = at::empty({M, N}, x.options());
    const auto xb = x.contiguous();
    for (int64_t n0 = 0; n0 < N; n0 += panel) {
      const int64_t rows = std::min(panel, N - n0);
      out.narrow(1, n0, rows).copy_(at::mm(xb, w.narrow(0, n0, rows).to(at::kBFloat16).t()));
    }
    return out;
  }
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, xf.options());
  if (M == 0) {
    // nothing to compute
  } else if (M <= kMaxRows) {
    if (is_half) few_rows(xf.data_ptr<float>(), M, w.data_ptr<at::Half>(), N, K, out.data_ptr<float>());
    else few_rows(xf.data_ptr<float>(), M, w.data_ptr<at::BFloat16>(), N, K, out.data_ptr<float>());
  } else {
    const int64_t panel = std::min(N, std::max<int64_t>(64, kPanelBytes / (4 * K)));
    auto widened = at::empty({panel, K}, xf.options());
    for (int64_t n0 = 0; n0 < N; n0 += panel) {
      const int64_t rows = std::min(panel, N - n0);
      if (is_half) widen_rows(w.data_ptr<at::Half>() + n0 * K, rows, K, widened.data_ptr<float>());
      else widen_rows(w.data_ptr<at::BFloat16>() + n0 * K, rows, K, widened.data_ptr<float>());
      auto slice = out.narrow(1, n0, rows);
      slice.copy_(at::mm(xf, widened.narrow(0, 0, rows).t()));
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}
