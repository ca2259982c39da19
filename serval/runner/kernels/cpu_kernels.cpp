// The torch-facing small kernels: the bf16 small-batch matmul, RMSNorm, a row-wise argmax, SwiGLU's silu * up,
// in-place RoPE, the new K/V rows' writes into their cache slots.
#include "common.h"

using namespace serval_kernels;

// y = x @ w.T for a few rows of x (decode), bf16 weights streamed once. oneDNN's bf16 GEMM is tuned for many
// rows; with one to eight it reads weights far below memory bandwidth. With AVX512-BF16 the products are
// VDPBF16PS dot products; elsewhere the bf16 values are widened to fp32 in registers (a shift) and FMA'd.
namespace {

template <int R>  // rows of x
void bf16_rows(const uint16_t* w_row, const uint16_t* x, int64_t K, at::BFloat16* out, int64_t out_stride) {
#if defined(__AVX512BF16__)
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w_row + k);
    for (int m = 0; m < R; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
  }
  for (int m = 0; m < R; ++m) out[m * out_stride] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m]));
#else
  using simd::Vec;
  const auto* wp = reinterpret_cast<const at::BFloat16*>(w_row);
  const auto* xp = reinterpret_cast<const at::BFloat16*>(x);
  Vec acc[R];
  for (int m = 0; m < R; ++m) acc[m] = simd::zero();
  for (int64_t k = 0; k < K; k += simd::kWidth) {
    const Vec wv = simd::load(wp + k);
    for (int m = 0; m < R; ++m) acc[m] = simd::fmadd(wv, simd::load(xp + m * K + k), acc[m]);
  }
  for (int m = 0; m < R; ++m) out[m * out_stride] = static_cast<at::BFloat16>(simd::reduce_add(acc[m]));
#endif
}

using Bf16Rows = void (*)(const uint16_t*, const uint16_t*, int64_t, at::BFloat16*, int64_t);

template <int... Rows>
Bf16Rows bf16_rows_for(int64_t rows, std::integer_sequence<int, Rows...>) {
  Bf16Rows run = nullptr;
  ((rows == Rows + 1 ? (run = bf16_rows<Rows + 1>, 0) : 0), ...);
  return run;
}

}  // namespace

at::Tensor bf16_linear_small_batch(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes must be (M, K) and (N, K)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto out = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  parallel_chunks(N, std::max<int64_t>(16, N / 32), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      // Rows of x in groups of 8 (their accumulators stay in registers); the weight row stays in L1 across
      // groups, so weights are read from memory once whatever M is.
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t rows = std::min<int64_t>(8, M - m0);
        bf16_rows_for(rows, std::make_integer_sequence<int, 8>())(wp + n * K, xp + m0 * K, K, op + m0 * N + n, N);
      }
    }
  });
  return out;
}

// RMSNorm over the last dimension, computed in fp32 whatever comes in; the result has the weight's dtype.
// One op instead of PyTorch's eight small ones (cast, pow, mean, add, rsqrt, mul, mul, cast) per call. Each
// row's sum of squares goes in vector lanes, then across them: a fixed order per row whatever the row count
// (batch invariance), and the rows are split over the threads. As one chunk of scalar loops (its grain was
// 64 rows) a 64-row decode step's norms ran on one thread, the other waiting: 2.9% of the step (`perf`).
template <typename In, typename Out>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  constexpr int W = simd::kWidth;
  const int64_t rows = x.size(0), dim = x.size(1), vector_end = dim / W * W;
  const In* xp = x.data_ptr<In>();
  const Out* wp = w.data_ptr<Out>();
  Out* op = out.data_ptr<Out>();
  parallel_chunks(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* xr = xp + r * dim;
      const float sum = dot(xr, xr, dim);
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
      Out* orow = op + r * dim;
      const simd::Vec scale_v = simd::set1(scale);
      for (int64_t d = 0; d < vector_end; d += W)
        simd::store(orow + d, simd::mul(simd::mul(simd::load(xr + d), scale_v), simd::load(wp + d)));
      for (int64_t d = vector_end; d < dim; ++d) orow[d] = static_cast<Out>(to_float(xr[d]) * scale * to_float(wp[d]));
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "x (rows, dim), weight (dim)");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty(xc.sizes(), xc.options().dtype(wc.scalar_type()));
  const auto in = xc.scalar_type(), w = wc.scalar_type();
  if (in == at::kFloat && w == at::kBFloat16) rms_norm_impl<float, at::BFloat16>(xc, wc, eps, out);
  else if (in == at::kFloat && w == at::kFloat) rms_norm_impl<float, float>(xc, wc, eps, out);
  else if (in == at::kBFloat16 && w == at::kBFloat16) rms_norm_impl<at::BFloat16, at::BFloat16>(xc, wc, eps, out);
  else TORCH_CHECK(false, "rms_norm: unsupported dtypes");
  return out;
}

// Each row's index of its largest value, as torch.argmax gives it: the first of equal maxima, and a NaN counts
// as the largest (the first NaN). torch's index reduction took 0.85 ms over a 64 x 49152 decode step's logits
// (2 threads, AMD family 26), its max alone 0.08; this, a vector max (NaN lanes found with it) and then the
// first index that holds it, 0.25.
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: (rows, n) fp32");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1), vector_end = n / simd::kWidth * simd::kWidth;
  TORCH_CHECK(n > 0, "argmax of an empty row");
  auto out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_chunks(rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      simd::Vec largest = simd::set1(-INFINITY);
      bool nan = false;
      for (int64_t i = 0; i < vector_end; i += simd::kWidth) {
        const simd::Vec v = simd::load(row + i);
        nan |= simd::any_nan(v);
        largest = simd::max(largest, v);
      }
      float m = simd::reduce_max(largest);
      for (int64_t i = vector_end; i < n; ++i) nan |= simd::is_nan(row[i]), m = std::max(m, row[i]);
      int64_t at = 0;
      if (nan) {
        while (!simd::is_nan(row[at])) ++at;
      } else {
        while (at + 1 < n && row[at] != m) ++at;  // bounded: m is one of the row's values
      }
      op[r] = at;
    }
  });
  return out;
}

// SwiGLU's silu(gate) * up over (rows, 2 * inter) -> (rows, inter), in one pass (common.h's silu_mul_span).
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), inter = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * inter;
      silu_mul_span(g, g + inter, op + r * inter, inter);
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (rows, 2 * inter)");
  auto gc = gate_up.contiguous();
  auto out = at::empty({gc.size(0), gc.size(1) / 2}, gc.options());
  if (gc.scalar_type() == at::kBFloat16) silu_mul_impl<at::BFloat16>(gc, out);
  else if (gc.scalar_type() == at::kFloat) silu_mul_impl<float>(gc, out);
  else TORCH_CHECK(false, "silu_mul: unsupported dtype");
  return out;
}

// Neox-style RoPE applied in place to q (tokens, heads, head_dim) and k (tokens, kv_heads, head_dim), which
// may be strided views of the fused qkv output; cos and sin are (tokens, head_dim / 2) float32. The rotation
// is computed in fp32 and rounded once.
template <typename T>
void rope_impl(at::Tensor& x, const float* cos, const float* sin, int64_t half) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* base = x.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = base + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(p[i]), x2 = to_float(p[i + half]);
          p[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          p[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void rotary_embedding_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: (tokens, heads, dim)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin: float32");
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  const int64_t half = q.size(2) / 2;
  TORCH_CHECK(c.numel() == q.size(0) * half && s.numel() == q.size(0) * half, "cos/sin: (tokens, dim / 2)");
  for (at::Tensor x : {q, k}) {
    if (x.scalar_type() == at::kBFloat16) rope_impl<at::BFloat16>(x, c.data_ptr<float>(), s.data_ptr<float>(), half);
    else if (x.scalar_type() == at::kFloat) rope_impl<float>(x, c.data_ptr<float>(), s.data_ptr<float>(), half);
    else TORCH_CHECK(false, "rotary_embedding_: unsupported dtype");
  }
}

// Each row of src into its slot of the cache, in the cache's form: a copy where the dtypes match; a bf16 cache
// under fp32 or fp16 compute (`--kv-cache-dtype bfloat16`) and an fp8 e5m2 one get simd::store's rounding,
// which is torch's .to(); an int8 cache codes and a scale a row, as cache_dtype.quantize_rows
// (tests/runner/test_kv_cache_dtype.py compares the bytes of both). A row copy each: index_copy_ costs more per
// call.
namespace {

template <typename Source, typename Target>
void store_rows_rounded(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t rows = src.size(0), n = src.size(1) * src.size(2), stride = src.stride(0);
  const auto* from = static_cast<const Source*>(src.data_ptr());
  auto* to = static_cast<Target*>(cache.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const Source* row = from + r * stride;
    Target* slot = to + slots[r] * n;
    int64_t i = 0;
    for (; i + simd::kWidth <= n; i += simd::kWidth) simd::store(slot + i, simd::load(row + i));
    for (; i < n; ++i) slot[i] = static_cast<Target>(to_float(row[i]));
  }
}

// An int8 cache (`--kv-cache-dtype int8`): each (token, kv head) row of head_dim values becomes codes
// round(x / scale) and its scale, max |x| / 127, in the scales after the codes (common.h's Int8Row), computed as
// cache_dtype.py's quantize_rows computes them (scale = max|x| * fp32(1/127), codes = round-to-even(x *
// (1 / scale))), so that the bytes are equal.
template <typename Source>
void store_rows_int8(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t rows = src.size(0), heads = src.size(1), head_dim = src.size(2), stride = src.stride(0);
  const auto* from = static_cast<const Source*>(src.data_ptr());
  auto* codes = static_cast<int8_t*>(cache.data_ptr());
  auto* scales = const_cast<float*>(int8_row_scales(cache));
  std::vector<float> x(head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      load_row(from + r * stride + h * head_dim, x.data(), head_dim);
      simd::Vec vmax = simd::zero();
      int64_t i = 0;
      for (; i + simd::kWidth <= head_dim; i += simd::kWidth) {
        const simd::Vec v = simd::load(x.data() + i);
        vmax = simd::max(vmax, simd::max(v, simd::sub(simd::zero(), v)));
      }
      float amax = simd::reduce_max(vmax);
      for (; i < head_dim; ++i) amax = std::max(amax, std::abs(x[i]));
      // volatile: under -ffast-math the compiler would fold 1 / (amax * (1/127)) into 127 / amax, which rounds
      // differently (a code one off at a tie, measured).
      const volatile float rounded_scale = amax * (1.0f / 127.0f);
      const float scale = rounded_scale;
      const float inverse = amax > 0.0f ? 1.0f / scale : 0.0f;
      const int64_t row_index = slots[r] * heads + h;
      int8_t* row = codes + row_index * head_dim;
      const simd::Vec inv = simd::set1(inverse);
      for (i = 0; i + simd::kWidth <= head_dim; i += simd::kWidth)
        simd::store_whole(simd::round_nearest(simd::mul(simd::load(x.data() + i), inv)), row + i);
      for (; i < head_dim; ++i) row[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
      scales[row_index] = scale;
    }
  }
}

// A narrower cache's rows from fp32, bf16 or fp16 ones.
template <typename Source>
void store_rows_narrowed(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  if (cache.scalar_type() == at::kChar) store_rows_int8<Source>(src, cache, slots);
  else if (cache.scalar_type() == at::kBFloat16) store_rows_rounded<Source, at::BFloat16>(src, cache, slots);
  else store_rows_rounded<Source, at::Float8_e5m2>(src, cache, slots);
}

}  // namespace

void store_cache_rows(at::Tensor src, at::Tensor cache, at::Tensor slots) {
  TORCH_CHECK(src.dim() == 3 && cache.dim() == 3 && src.size(1) == cache.size(1) && cache.size(2) == src.size(2),
              "src: (rows, heads, head_dim), cache: (slots, heads, head_dim)");
  TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2) && cache.is_contiguous(),
              "each src row contiguous, the cache contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == src.size(0),
              "one int64 slot per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  if (cache.scalar_type() == src.scalar_type()) {
    const int64_t row_bytes = src.size(1) * src.size(2) * src.element_size();
    const auto* from = static_cast<const char*>(src.data_ptr());
    auto* to = static_cast<char*>(cache.data_ptr());
    for (int64_t r = 0; r < src.size(0); ++r)
      std::memcpy(to + slot[r] * row_bytes, from + r * src.stride(0) * src.element_size(), row_bytes);
    return;
  }
  const auto cache_type = cache.scalar_type();
  TORCH_CHECK(cache_type == at::kBFloat16 || cache_type == at::kFloat8_e5m2 || cache_type == at::kChar,
              "a cache of the rows' dtype, bf16, fp8 e5m2 or int8");
  if (src.scalar_type() == at::kFloat) store_rows_narrowed<float>(src, cache, slot);
  else if (src.scalar_type() == at::kBFloat16) store_rows_narrowed<at::BFloat16>(src, cache, slot);
  else if (src.scalar_type() == at::kHalf) store_rows_narrowed<at::Half>(src, cache, slot);
  else TORCH_CHECK(false, "rows of fp32, bf16 or fp16");
}
