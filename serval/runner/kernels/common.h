// Shared by the kernel sources: scalar conversions and row helpers over simd.h's vectors, and the torch-level ops
// that decode_stack.cpp composes into a whole decoder layer.
#pragma once
// ATen's tensor and the few operators the kernels call, not <torch/extension.h>: that header (all of torch's
// C++ API and Python bindings) took 28 s to compile per file, most of each variant's build.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#include "simd.h"

namespace serval_kernels {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::Float8_e5m2 x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + simd::kWidth <= n; i += simd::kWidth) simd::store(dst + i, simd::load(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// out = silu(gate) * up = gate / (1 + e^-gate) * up, SwiGLU's activation, each value in vector lanes whatever n (a
// tail goes through a padded vector), so that a value's bits do not depend on its position or the row's length:
// silu_mul over a whole row and the fused gate_up matmul over 16 columns at a time (quantized.h) agree.
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t n) {
  constexpr int W = simd::kWidth;
  const auto lanes = [](simd::Vec g, simd::Vec u) {
    const simd::Vec e = simd::exp_bounded(simd::sub(simd::zero(), g));
    return simd::mul(simd::div(g, simd::add(simd::set1(1.0f), e)), u);
  };
  int64_t i = 0;
  for (; i + W <= n; i += W) simd::store(out + i, lanes(simd::load(gate + i), simd::load(up + i)));
  if (i == n) return;
  alignas(64) T g[W] = {}, u[W] = {}, o[W];
  std::copy(gate + i, gate + n, g);
  std::copy(up + i, up + n, u);
  simd::store(o, lanes(simd::load(g), simd::load(u)));
  std::copy(o, o + (n - i), out + i);
}

// a . b in vector lanes, then across them, then the tail: a fixed order for a given n. a and b: fp32 or bf16.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  simd::Vec acc = simd::zero();
  int64_t i = 0;
  for (; i + simd::kWidth <= n; i += simd::kWidth) acc = simd::fmadd(simd::load(a + i), simd::load(b + i), acc);
  float sum = simd::reduce_add(acc);
  for (; i < n; ++i) sum += to_float(a[i]) * to_float(b[i]);
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const simd::Vec a = simd::set1(alpha);
  int64_t i = 0;
  for (; i + simd::kWidth <= n; i += simd::kWidth) simd::store(y + i, simd::fmadd(a, simd::load(x + i), simd::load(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// f(std::integral_constant<int, R>{}) for R = rows where 1 <= rows < Max, else Max: the one switch from a
// pass's row count to a kernel compiled for it (whose accumulators are then registers).
template <int Max, int R = 1, typename F>
decltype(auto) with_row_count(int64_t rows, F&& f) {
  if constexpr (R < Max) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    return with_row_count<Max, R + 1>(rows, std::forward<F>(f));
  } else {
    return f(std::integral_constant<int, Max>{});
  }
}

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

// f(task, next, scratch) for each task in [0, n), handed out up to `max_run` consecutive tasks at a time as the
// threads ask (parallel_chunks' kDynamic, for tasks of microseconds). `next` is the task the same thread runs
// after this one, or -1 where that is not known (a run's last), so that f can ask for its first data ahead;
// each thread keeps one Scratch for all its tasks (allocating per task took 3-4% of a 64-sequence decode
// step's attention: malloc and free, `perf`). Runs are shortened to give every thread as many: with few tasks,
// whole runs of max_run left threads idle (decode attention of one sequence of 3 kv heads, 1,000 tokens, 2
// threads: 1.43 -> 1.11 ms for 30 layers; 2 sequences 2.26 -> 1.91; AMD family 26).
template <typename Scratch, typename F>
inline void parallel_task_runs(int64_t n, int64_t max_run, const F& f) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t runs_a_thread = std::max<int64_t>(1, (n + threads * max_run - 1) / (threads * max_run));
  const int64_t run = std::max<int64_t>(1, (n + threads * runs_a_thread - 1) / (threads * runs_a_thread));
  const int64_t num_runs = (n + run - 1) / run;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_runs);
  const auto run_tasks = [&](int64_t r, Scratch& scratch) {
    const int64_t end = std::min(n, (r + 1) * run);
    for (int64_t task = r * run; task < end; ++task) f(task, task + 1 < end ? task + 1 : -1, scratch);
  };
  if (num_threads <= 1 || at::in_parallel_region()) {
    Scratch scratch;
    for (int64_t r = 0; r < num_runs; ++r) run_tasks(r, scratch);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < num_runs; ++r) run_tasks(r, scratch);
  }
}

// An int8 KV cache (`--kv-cache-dtype int8`): a contiguous tensor of int8 codes (..., head_dim) whose buffer goes on
// past them with one fp32 scale a row, in the rows' order; a value is code * its row's scale. The rows stay
// head_dim bytes, so a 64-wide row is one cache line (a scale inside each row split most rows over two lines:
// 8.4-8.9 against fp8's 5.8-6.3 ms for a 64-sequence step's attention). The kernels take Int8Row as the cache's
// element type and look a row's scale up by its element offset.
struct Int8Row {
  int8_t code;
};

// An int8 cache tensor's scales (null for any other dtype), after checking that its buffer holds them.
inline const float* int8_row_scales(const at::Tensor& cache) {
  if (cache.scalar_type() != at::kChar) return nullptr;
  const int64_t rows = cache.numel() / cache.size(-1);
  const int64_t end = cache.storage_offset() + cache.numel() + rows * static_cast<int64_t>(sizeof(float));
  TORCH_CHECK(cache.is_contiguous() && cache.size(-1) % 4 == 0 && static_cast<int64_t>(cache.storage().nbytes()) >= end,
              "an int8 KV cache: contiguous rows of a multiple of 4 codes, its buffer holding a scale a row after them");
  return reinterpret_cast<const float*>(static_cast<const int8_t*>(cache.data_ptr()) + cache.numel());
}

// The scale of the cache row at element offset `offset` (rows of head_dim): 1 where the cache has none.
inline float row_scale(const float* scales, int64_t offset, int64_t head_dim) {
  return scales != nullptr ? scales[offset / head_dim] : 1.0f;
}

// n values of a cache row as fp32: widened exactly, or an int8 row's codes times its scale (one product each,
// the same wherever a kernel widens a row: batch invariance).
template <typename K>
inline void load_cache_row(const K* row, float* dst, int64_t n, float scale) {
  if constexpr (std::is_same_v<K, Int8Row>) {
    const auto* codes = reinterpret_cast<const int8_t*>(row);
    const simd::Vec s = simd::set1(scale);
    int64_t i = 0;
    for (; i + simd::kWidth <= n; i += simd::kWidth) simd::store(dst + i, simd::mul(simd::load(codes + i), s));
    for (; i < n; ++i) dst[i] = static_cast<float>(codes[i]) * scale;
  } else {
    load_row(row, dst, n);
  }
}

// One cache row read a vector at a time (the V pass, straight from the cache): load(i) is the W values at i.
template <typename K>
struct CacheRow {
  const K* row;
  CacheRow(const K* r, float) : row(r) {}
  simd::Vec load(int64_t i) const { return simd::load(row + i); }
};
template <>
struct CacheRow<Int8Row> {
  const int8_t* codes;
  simd::Vec scale;
  CacheRow(const Int8Row* r, float s) : codes(reinterpret_cast<const int8_t*>(r)), scale(simd::set1(s)) {}
  simd::Vec load(int64_t i) const { return simd::mul(simd::load(codes + i), scale); }
};

// f(Q{}, K{}) for the attention kernels' query and output dtype Q and their cache's element type K: the cache
// holds q's dtype, bf16 under an fp32 or fp16 q (`--kv-cache-dtype bfloat16`) or fp8 e5m2 (`fp8_e5m2`), both
// widened exactly as they are read, or int8 codes with a scale a row after them (`int8`, Int8Row).
template <typename F>
void with_attention_types(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, F&& f) {
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e5m2, int8 = cache_type == at::kChar, bf16 = cache_type == at::kBFloat16;
  TORCH_CHECK(v_cache.scalar_type() == cache_type && (fp8 || int8 || bf16 || cache_type == q.scalar_type()),
              "the KV cache: q's dtype, bf16, fp8 e5m2 or int8 rows, K and V alike");
  TORCH_CHECK(k_cache.size(-1) == q.size(-1), "cache rows of q's head_dim");
  const auto with_cache = [&](auto query) {
    if (fp8) f(query, at::Float8_e5m2{});
    else if (int8) f(query, Int8Row{});
    else if (bf16) f(query, at::BFloat16{});
    else f(query, query);
  };
  if (q.scalar_type() == at::kFloat) with_cache(float{});
  else if (q.scalar_type() == at::kBFloat16) with_cache(at::BFloat16{});
  else if (q.scalar_type() == at::kHalf) with_cache(at::Half{});
  else TORCH_CHECK(false, "unsupported dtype");
}

// The attention kernels' per-head sink logits (gpt-oss): an fp32 tensor of one per query head, or an empty
// (or undefined) one for none (a null pointer).
inline const float* sink_logits(const at::Tensor& sinks, int64_t num_heads) {
  if (!sinks.defined() || sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == num_heads,
              "sinks: contiguous fp32, one per query head");
  return sinks.data_ptr<float>();
}

// The scaled q.k of one query with the W keys of a tile, a key a lane: the one way both attention kernels
// form a score, so that a query's bits are the same whether it is decoded or sits in a prefill chunk of any
// length (batch invariance: docs/architecture.md). q: the query's D values in fp32 registers (C = D / W of
// them, C even); key(i) points at key i's D values (the cache's dtype or fp32: widened exactly); lanes from
// num_keys on are zero. Each key's products go in two chains (even and odd vectors), added, and summed
// across the vector by sum_each; the scale is applied last.
template <int C, typename KeyRow>
inline simd::Vec tile_scores(const simd::Vec* q, int64_t num_keys, KeyRow key, simd::Vec scale) {
  static_assert(C >= 2 && C % 2 == 0, "two chains of whole vectors");
  constexpr int W = simd::kWidth;
  simd::Vec partial[W];
  for (int64_t i = 0; i < W; ++i) {
    if (i >= num_keys) { partial[i] = simd::zero(); continue; }
    const auto* k = key(i);
    simd::Vec a = simd::mul(q[0], simd::load(k)), b = simd::mul(q[1], simd::load(k + W));
    for (int j = 2; j < C; j += 2) {
      a = simd::fmadd(q[j], simd::load(k + W * j), a);
      b = simd::fmadd(q[j + 1], simd::load(k + W * (j + 1)), b);
    }
    partial[i] = simd::add(a, b);
  }
  return simd::mul(simd::sum_each(partial), scale);
}

// Both attention kernels' V passes: output vectors a chunk, and the accumulators a pass keeps in registers.
// AVX-512 (32 registers): all of a head of up to 16 vectors, else 8 (a 512-wide latent), 16 accumulators. AVX2
// (16 registers): chunks of 4 vectors and 12 accumulators, beside the weights and one V vector. Each output
// value's sum goes over the same keys in the same order whatever the chunk (batch invariance).
constexpr int value_chunk(int vectors) {
  return simd::kWidth == 16 ? (vectors <= 16 ? vectors : 8) : std::min(vectors, 4);
}
constexpr int kValueAccumulators = simd::kWidth == 16 ? 16 : 12;

// A tile's lanes of `a` for the keys in [first, position], `outside` elsewhere: tile t holds keys t W ..
// t W + W - 1 (W = kWidth), positions counted as the caller counts them. Both attention kernels mask by it.
inline simd::Vec visible_lanes(int64_t first, int64_t position, int64_t tile, simd::Vec a, simd::Vec outside) {
  constexpr int64_t W = simd::kWidth;
  const int64_t before = std::clamp<int64_t>(first - tile * W, 0, W);
  const int64_t through = std::clamp<int64_t>(position - tile * W + 1, 0, W);
  return simd::first_lanes(before, outside, simd::first_lanes(through, a, outside));
}

}  // namespace serval_kernels

// window: a query sees the last `window` positions up to its own (0: all); sinks: see sink_logits. value_dim
// (MLA's latent attention): values are the first value_dim of each V row, the output that wide (0: head_dim).
at::Tensor paged_decode_attention(
    at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
    at::Tensor context_lens, double scale, int64_t window, at::Tensor sinks, int64_t value_dim = 0);
void paged_prefill_attention(
    at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
    at::Tensor query_starts, at::Tensor query_lens, at::Tensor context_lens, double scale,
    at::Tensor out, int64_t window, at::Tensor sinks);
at::Tensor bf16_linear_small_batch(at::Tensor x, at::Tensor w);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor argmax_rows(at::Tensor x);
void store_cache_rows(at::Tensor src, at::Tensor cache, at::Tensor slots);
at::Tensor silu_mul(at::Tensor gate_up);
void rotary_embedding_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor quantized_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                               at::Tensor super_scales, int64_t N, bool int8_batch_activations);
// silu_mul(quantized_linear(...)) of a SwiGLU gate_up matrix (N = 2 inter), the same bits, fused where it can be.
at::Tensor quantized_swiglu(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                            at::Tensor super_scales, int64_t N, bool int8_batch_activations);
// residual += quantized_linear(...), the same bits, without the result where the int8 path adds it group by group.
void quantized_linear_add_(at::Tensor residual, at::Tensor x, at::Tensor codes, at::Tensor scales,
                           at::Tensor offsets, at::Tensor super_scales, int64_t N, bool int8_batch_activations);
// From how many rows of x int8_batch_activations rounds x to int8 where the build has the layout (has_int8_rows;
// quantized_int8.cpp says why per build); 0 where this build has no int8 path.
int64_t int8_rows_from();
// The rows of x an AMX tile product takes where this process uses AMX for the int8 path (int8_rows_amx.h): 16,
// or 0 (no AMX-INT8, not granted by Linux, SERVAL_DISABLE_AMX=1, or a build without it).
int64_t int8_tile_rows();
// x @ w.T for dense w (N, K) in fp32, bf16 or f16, each output summed over K in one order whatever x's row
// count (dense_linear.cpp); the result in x's dtype. Also quantized_linear's 16-bit layout (GGUF F16/BF16).
at::Tensor dense_linear(at::Tensor x, at::Tensor w);
// dense_linear on each head at once: x (heads, M, K), w (heads, N, K) -> (heads, M, N), head h's rows exactly
// dense_linear(x[h], w[h])'s (MLA's absorbed per-head projections, runner/mla.py).
at::Tensor dense_linear_heads(at::Tensor x, at::Tensor w);
// A sparse MoE layer's routed experts over packed stacked expert matrices (moe.cpp); (tokens, hidden) fp32.
at::Tensor moe_experts(at::Tensor x, at::Tensor expert_ids, at::Tensor expert_weights, std::vector<at::Tensor> gate,
                       std::vector<at::Tensor> up, std::vector<at::Tensor> down, at::Tensor gate_bias,
                       at::Tensor up_bias, at::Tensor down_bias, int64_t num_experts, int64_t inter, int64_t hidden,
                       int64_t activation, double alpha, double limit, bool int8_batch_activations);
// A MoE router's logits, one fixed-order dot product per (token, expert) (moe.cpp).
at::Tensor router_logits(at::Tensor x, at::Tensor w);
// A GGUF block-quantized matrix's bytes in the packed layout (gguf_repack.cpp): [codes, scales, offsets, super].
std::vector<at::Tensor> pack_gguf_blocks(at::Tensor raw, int64_t type, int64_t rows, int64_t K);
std::vector<at::Tensor> gguf_packed_buffers(int64_t type, int64_t rows, int64_t K);
void pack_gguf_blocks_into(at::Tensor raw, int64_t type, int64_t rows, int64_t K, std::vector<at::Tensor> out,
                           int64_t first_group);
