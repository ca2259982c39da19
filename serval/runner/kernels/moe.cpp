// A sparse MoE layer's routed experts in one call: y[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t]), each expert
// a SwiGLU MLP whose gate, up and down projections are rows of three packed stacks (runner/moe.py: expert e's
// gate rows are e * inter .. (e + 1) * inter - 1, in any layout quantized.h packs, at the file's size).
//
// The step's (token, choice) slots are grouped by expert (a counting sort, stable in slot order), and every
// expert's rows gathered into one block of x. Then two parallel phases, each over (expert, block of output
// groups) work items handed out one at a time, so the threads work on different experts at once (not one
// expert after another, as llama.cpp's mul_mat_id does) and no weight is read for a row that did not choose
// it:
//   1. gate and up for an item's columns of the intermediate, silu(gate) * up written straight into them;
//   2. down for an item's columns of the output.
// Each item's matmul is quantized_linear's for fp32 x (matmul_packed_rows: int8 or int16 x, each row alike
// whatever the expert's row count), run on the calling thread. A token's outputs are then summed in its choices'
// order, so its result does not depend on which other tokens share the step.
#include "quantized.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

// One of the three stacks, with what it takes to address an expert's groups.
struct Stack {
  PackedMatrix w;
  Layout layout;
  int64_t scale_bytes, offset_bytes, super_halves;  // per group of 16 rows
  int64_t groups_per_expert;

  // Groups [first, first + count) of expert e's rows as a matrix of their own.
  PackedMatrix groups(int64_t e, int64_t first) const {
    const int64_t g = e * groups_per_expert + first;
    PackedMatrix view = w;
    view.codes = w.codes + g * w.group_bytes;
    view.scales = static_cast<const uint8_t*>(w.scales) + g * scale_bytes;
    if (w.offsets != nullptr) view.offsets = static_cast<const uint8_t*>(w.offsets) + g * offset_bytes;
    if (w.super != nullptr) view.super = w.super + g * super_halves;
    return view;
  }
};

Stack make_stack(const std::vector<at::Tensor>& parts, int64_t K, int64_t rows_per_expert, int64_t num_experts,
                 const char* name) {
  TORCH_CHECK(parts.size() == 4, name, ": [codes, scales, offsets, super_scales]");
  const at::Tensor &codes = parts[0], &scales = parts[1], &offsets = parts[2], &super = parts[3];
  TORCH_CHECK(codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar,
              name, ": packed block codes (16-bit stacks take the PyTorch path)");
  TORCH_CHECK(rows_per_expert % kGroup == 0, name, ": an expert's rows must be whole groups of 16");
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) * kGroup == rows_per_expert * num_experts, name,
              ": rows vs experts");
  const Layout layout = packed_layout(codes, scales, offsets, super, K);
  const PackedMatrix w{static_cast<const uint8_t*>(codes.data_ptr()), codes.stride(0), scales.data_ptr(),
                       present(offsets) ? offsets.data_ptr() : nullptr,
                       present(super) ? super.data_ptr<at::Half>() : nullptr, K};
  return Stack{w, layout, scales.stride(0) * scales.element_size(),
               present(offsets) ? offsets.stride(0) * offsets.element_size() : 0,
               present(super) ? super.stride(0) : 0, rows_per_expert / kGroup};
}

// A work item: groups [first, first + count) of expert e's output rows.
struct Item {
  int64_t expert, first, count;
};

// Items of at most `span` groups over every expert that has rows.
std::vector<Item> items_of(const std::vector<int64_t>& counts, int64_t groups_per_expert, int64_t span) {
  std::vector<Item> items;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t g = 0; g < groups_per_expert; g += span) items.push_back({e, g, std::min(span, groups_per_expert - g)});
  }
  return items;
}

// Groups per item: enough items for every thread to take several (balance), each still whole groups.
int64_t item_span(int64_t groups_per_expert, int64_t num_used_experts) {
  const int64_t wanted = 8 * std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_expert = std::max<int64_t>(1, wanted / std::max<int64_t>(1, num_used_experts));
  return std::max<int64_t>(1, (groups_per_expert + per_expert - 1) / per_expert);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// The expert MLP's activation of one intermediate column (runner/moe.py ACTIVATIONS): 0 silu(g) u; 1 gpt-oss's
// clamped SwiGLU, g = min(g, limit), u = clamp(u, -limit, limit), g sigmoid(alpha g) (u + 1).
struct Activation {
  int64_t kind;
  float alpha, limit;
  float operator()(float g, float u) const {
    if (kind == 0) return silu(g) * u;
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
    return g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
  }
};

// A stack's bias (num_experts * rows fp32), or null without one.
const float* bias_of(const at::Tensor& bias, int64_t rows, const char* name) {
  if (!present(bias)) return nullptr;
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == rows, name,
              " bias: contiguous fp32, one per stacked row");
  return bias.data_ptr<float>();
}

// out[j * out_stride] = dot(x + j * n, w, n) for the R <= 4 rows of x, each with dot()'s one chain and order.
inline void dots_of_row(const float* x, int64_t R, const float* w, int64_t n, float* out, int64_t out_stride) {
  simd::Vec acc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  int64_t i = 0;
  for (; i + simd::kWidth <= n; i += simd::kWidth) {
    const simd::Vec wv = simd::load(w + i);
    for (int64_t j = 0; j < R; ++j) acc[j] = simd::fmadd(simd::load(x + j * n + i), wv, acc[j]);
  }
  for (int64_t j = 0; j < R; ++j) {
    float sum = simd::reduce_add(acc[j]);
    for (int64_t k = i; k < n; ++k) sum += x[j * n + k] * w[k];
    out[j * out_stride] = sum;
  }
}

}  // namespace

// x: (T, hidden) fp32 or bf16; expert_ids (T, k) int64 and expert_weights (T, k) fp32 from the router. The
// stacks: gate and up (num_experts * inter rows, hidden), down (num_experts * hidden rows, inter), each as
// [codes, scales, offsets, super_scales], and their fp32 biases (empty: none). Returns (T, hidden) fp32.
at::Tensor moe_experts(at::Tensor x, at::Tensor expert_ids, at::Tensor expert_weights, std::vector<at::Tensor> gate,
                       std::vector<at::Tensor> up, std::vector<at::Tensor> down, at::Tensor gate_bias,
                       at::Tensor up_bias, at::Tensor down_bias, int64_t num_experts, int64_t inter, int64_t hidden,
                       int64_t activation, double alpha, double limit, bool int8_batch_activations) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden, "x: (tokens, hidden)");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0) && expert_ids.scalar_type() == at::kLong,
              "expert_ids: (tokens, k) int64");
  TORCH_CHECK(expert_weights.sizes() == expert_ids.sizes() && expert_weights.scalar_type() == at::kFloat,
              "expert_weights: (tokens, k) fp32");
  TORCH_CHECK(hidden % kBlock == 0 && inter % kBlock == 0, "hidden and inter: multiples of 32");
  const Stack gate_stack = make_stack(gate, hidden, inter, num_experts, "gate");
  const Stack up_stack = make_stack(up, hidden, inter, num_experts, "up");
  const Stack down_stack = make_stack(down, inter, hidden, num_experts, "down");
  const float* gate_b = bias_of(gate_bias, num_experts * inter, "gate");
  const float* up_b = bias_of(up_bias, num_experts * inter, "up");
  const float* down_b = bias_of(down_bias, num_experts * hidden, "down");
  TORCH_CHECK(activation == 0 || activation == 1, "activation: 0 silu, 1 clamped SwiGLU");
  const Activation act_fn{activation, static_cast<float>(alpha), static_cast<float>(limit)};
  const int64_t T = x.size(0), k = expert_ids.size(1), num_slots = T * k;
  auto out = at::empty({T, hidden}, x.options().dtype(at::kFloat));
  std::fill_n(out.data_ptr<float>(), T * hidden, 0.0f);
  if (num_slots == 0) return out;
  const auto xf = x.to(at::kFloat).contiguous();
  const auto ids = expert_ids.contiguous();
  const auto weights = expert_weights.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Counting sort of the slots by expert: expert e's rows are [starts[e], starts[e] + counts[e]).
  std::vector<int64_t> counts(num_experts, 0), starts(num_experts + 1, 0), position(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < num_experts, "expert id out of range");
    ++counts[id[s]];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] = starts[e] + counts[e];
  std::vector<int64_t> filled(starts.begin(), starts.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s) position[s] = filled[id[s]]++;
  int64_t num_used = 0;
  for (int64_t e = 0; e < num_experts; ++e) num_used += counts[e] > 0;

  // Each slot's token row, in expert order.
  std::vector<float> xs(num_slots * hidden), act(num_slots * inter), ys(num_slots * hidden);
  const float* xp = xf.data_ptr<float>();
  parallel_chunks(num_slots, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) std::memcpy(&xs[position[s] * hidden], xp + (s / k) * hidden, hidden * sizeof(float));
  });

  // Phase 1: gate and up, and the activation, per (expert, block of intermediate groups).
  const std::vector<Item> up_items = items_of(counts, gate_stack.groups_per_expert, item_span(gate_stack.groups_per_expert, num_used));
  parallel_chunks(static_cast<int64_t>(up_items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g, u;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = up_items[i];
      const int64_t rows = counts[item.expert], row0 = starts[item.expert], cols = item.count * kGroup;
      g.resize(rows * cols);
      u.resize(rows * cols);
      const float* xe = &xs[row0 * hidden];
      matmul_packed_rows(xe, rows, gate_stack.groups(item.expert, item.first), gate_stack.layout, item.count, g.data(), cols,
                         int8_batch_activations);
      matmul_packed_rows(xe, rows, up_stack.groups(item.expert, item.first), up_stack.layout, item.count, u.data(), cols,
                         int8_batch_activations);
      const int64_t col0 = item.expert * inter + item.first * kGroup;  // in the stacks' rows (the biases)
      for (int64_t r = 0; r < rows; ++r) {
        float* a = &act[(row0 + r) * inter + item.first * kGroup];
        for (int64_t c = 0; c < cols; ++c) {
          const float gv = g[r * cols + c] + (gate_b ? gate_b[col0 + c] : 0.0f);
          const float uv = u[r * cols + c] + (up_b ? up_b[col0 + c] : 0.0f);
          a[c] = act_fn(gv, uv);
        }
      }
    }
  }, Schedule::kDynamic);

  // Phase 2: down, per (expert, block of output groups), straight into the slot's output row.
  const std::vector<Item> down_items = items_of(counts, down_stack.groups_per_expert, item_span(down_stack.groups_per_expert, num_used));
  parallel_chunks(static_cast<int64_t>(down_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = down_items[i];
      const int64_t rows = counts[item.expert], row0 = starts[item.expert];
      float* y = &ys[row0 * hidden + item.first * kGroup];
      matmul_packed_rows(&act[row0 * inter], rows, down_stack.groups(item.expert, item.first), down_stack.layout,
                         item.count, y, hidden, int8_batch_activations);
      if (down_b != nullptr) {
        const float* b = down_b + item.expert * hidden + item.first * kGroup;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < item.count * kGroup; ++c) y[r * hidden + c] += b[c];
      }
    }
  }, Schedule::kDynamic);

  // Each token's weighted sum, in the order of its choices.
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_chunks(T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < k; ++j) axpy(wp[t * k + j], &ys[position[t * k + j] * hidden], op + t * hidden, hidden);
  });
  return out;
}

// The router's logits x @ w.T, w (num_experts, hidden) fp32: each (token, expert) one dot product in a fixed
// order, so a token's scores, and so its experts, do not depend on how many tokens share the step (a BLAS
// matmul's blocking changes with the row count, and its last bits with it).
at::Tensor router_logits(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (tokens, hidden), w (experts, hidden)");
  TORCH_CHECK(w.scalar_type() == at::kFloat, "router weight: fp32");
  const auto xf = x.to(at::kFloat).contiguous();
  const auto wc = w.contiguous();
  const int64_t T = x.size(0), E = w.size(0), H = x.size(1);
  auto out = at::empty({T, E}, xf.options());
  const float *xp = xf.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Split over experts, tokens inner: each thread reads its experts' rows once for all of the step's tokens
  // (the weight is 1 MB for 128 experts of 2048; split over tokens, a decode step's few rows ran on one
  // thread and a prefill read it once per chunk of tokens). Four tokens at a time share each load of the
  // expert's row and keep four FMA chains in flight; each token's own chain is dot()'s, so its bits do not
  // depend on which tokens it is computed beside.
  parallel_chunks(E, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < T; t0 += 16)  // 16 rows of x (128 KB at 2048 wide) stay in L2 across the experts
      for (int64_t e = begin; e < end; ++e)
        for (int64_t t = t0; t < std::min(T, t0 + 16); t += 4)
          dots_of_row(xp + t * H, std::min<int64_t>(4, T - t), wp + e * H, H, op + t * E + e, E);
  });
  return out;
}
