// Shared by the kernel sources: scalar conversions and AVX-512 vector helpers, and the torch-level ops
// that decode_stack.cpp composes into a whole decoder layer.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace serval_kernels {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#ifdef __AVX512F__
// bf16 -> fp32 is a 16-bit left shift of the bits; 16 at a time.
template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(wide));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// 16 elements of the cache's dtype as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (softmax after subtracting the max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and a
// degree-6 polynomial (relative error ~2e-7, below fp32 rounding of the sums it feeds).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // e^-87 is already below the smallest normal float
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
#endif

// How parallel_chunks hands out its chunks (see there).
enum class Schedule { kGuided, kDynamic };

// f(begin, end) over [0, n) in chunks of `grain`, handed out as the threads ask for them:
//   kGuided: each thread first takes a large share, then ever smaller pieces of what is left (matmuls,
//            whose chunks are small: handing them out one at a time doubles the cost of a decode matmul);
//   kDynamic: one chunk at a time (attention, whose tasks take microseconds each: guided's first big
//            shares made a 64-sequence step 20% slower).
// NOTE: not at::parallel_for's static split. In a server the engine's threads share the cores with the
// event loop and the HTTP clients; with a static split every thread waits at the end for a preempted one's
// whole share. One stream on 2 cores, 2 threads: static 11.1 ms a token, guided 6.0 ms (benchmarks.md).
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f, Schedule schedule = Schedule::kGuided) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t num_chunks = (n + grain - 1) / grain;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (num_threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  if (schedule == Schedule::kGuided) {
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t c = 0; c < num_chunks; ++c) f(c * grain, std::min(n, (c + 1) * grain));
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t c = 0; c < num_chunks; ++c) f(c * grain, std::min(n, (c + 1) * grain));
  }
}

}  // namespace serval_kernels

torch::Tensor paged_decode_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor context_lens, double scale);
void paged_prefill_attention(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor context_lens, double scale,
    torch::Tensor out);
torch::Tensor bf16_linear_small_batch(torch::Tensor x, torch::Tensor w);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
bool has_bf16_linear();
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                               int64_t N);
bool has_quantized_linear();
void register_decode_stack(pybind11::module& m);
