// Where an int8-row matmul's result goes (quantized_int8.cpp): the fp32 `out`, or, group by group as each
// completes in a thread's small tile, a bf16 tensor, a residual stream it is added to, or SwiGLU's activation.
#pragma once
#include "quantized.h"

namespace serval_kernels::quantized {

// Group G's M x 16 fp32 tile (row stride kGroup) to where `to` says, the columns past N (the padded end) dropped.
inline void emit_group(const float* tile, int64_t M, int64_t G, const GroupOutput& to) {
  const int64_t first = G * kGroup, columns = std::min<int64_t>(kGroup, to.N - first);
  for (int64_t r = 0; r < M; ++r) {
    const float* src = tile + r * kGroup;
    alignas(64) at::BFloat16 rounded[kGroup];
    at::BFloat16* dst = to.bf16 != nullptr ? to.bf16 + r * to.N + first : rounded;
    if (columns == kGroup) {
      for (int v = 0; v < kGroup; v += simd::kWidth) simd::store(dst + v, simd::load(src + v));
    } else {
      for (int64_t n = 0; n < columns; ++n) dst[n] = static_cast<at::BFloat16>(src[n]);
    }
    if (to.residual == nullptr) continue;
    float* sum = to.residual + r * to.N + first;
    if (columns == kGroup) {
      for (int v = 0; v < kGroup; v += simd::kWidth)
        simd::store(sum + v, simd::add(simd::load(sum + v), simd::load(dst + v)));
    } else {
      for (int64_t n = 0; n < columns; ++n) sum[n] += static_cast<float>(dst[n]);
    }
  }
}

// A SwiGLU item's gate and up tiles (M x 16 each) to silu(gate) * up in bf16 columns 16 item .. of to.bf16.
inline void emit_swiglu(const float* gate, const float* up, int64_t M, int64_t item, const GroupOutput& to) {
  for (int64_t r = 0; r < M; ++r) {
    alignas(64) at::BFloat16 g[kGroup], u[kGroup];
    for (int v = 0; v < kGroup; v += simd::kWidth) {
      simd::store(g + v, simd::load(gate + r * kGroup + v));
      simd::store(u + v, simd::load(up + r * kGroup + v));
    }
    silu_mul_span(g, u, to.bf16 + r * to.N + item * kGroup, kGroup);
  }
}

// What a thread holds while it runs a share of groups: nothing, or AMX's tile configuration (int8_rows_amx.h).
struct NoScope {
  int operator()() const { return 0; }
};

// An int8-row matmul's groups handed out over the threads, each group's fp32 columns made by fill(G, y, stride)
// (y: the group's first column of row 0, rows stride apart) into out, or into the thread's tile and then where
// `to` says (a SwiGLU item: group G and its up group G + num_groups / 2). fine: one item at a time (long items);
// else guided shares of runs of about 1/16 of them, so that each thread streams consecutive codes. scope() is
// made on the thread before each share and held until it is done.
template <typename Fill, typename Scope = NoScope>
void run_groups(int64_t M, int64_t num_groups, float* out, int64_t out_stride, const GroupOutput& to, bool fine,
                const Fill& fill, const Scope& scope = {}) {
  const int parts = to.swiglu ? 2 : 1;
  const int64_t items = num_groups / parts;
  parallel_chunks(items, fine ? 1 : items / 16, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] const auto held = scope();
    std::vector<float> tile(to.by_group() ? parts * M * kGroup : 0);
    for (int64_t item = begin; item < end; ++item) {
      for (int part = 0; part < parts; ++part) {
        const int64_t G = item + part * items;
        if (to.by_group()) fill(G, tile.data() + part * M * kGroup, kGroup);
        else fill(G, out + G * kGroup, out_stride);
      }
      if (to.swiglu) emit_swiglu(tile.data(), tile.data() + M * kGroup, M, item, to);
      else if (to.by_group()) emit_group(tile.data(), M, item, to);
    }
  }, fine ? Schedule::kDynamic : Schedule::kGuided);
}

}  // namespace serval_kernels::quantized
