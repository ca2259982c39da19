// The decoder layers of a decode-only step (one new token per sequence) in one native call.
//
// A decode step of a small model is mostly fixed cost: ~20 tensor ops per layer, each a Python call and a
// dispatch, against a few microseconds of arithmetic. DecodeStack holds every layer's weights and KV cache
// once (built after loading) and runs all layers per step without returning to Python, and without the GIL.
//
// It computes exactly what the Python path (models/llama.py with the native kernels) computes: the same
// kernels, rounding to the compute dtype at the same points, the residual stream in fp32. A test compares
// the two bit for bit. A sparse layer (runner/moe.py with its native kernels) routes as SparseMoe.route
// does, with the same ATen ops, and runs moe_experts; attention may have an output bias, sink logits and a
// window (gpt-oss).
#include "decode_stack.h"
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <optional>

#include "common.h"

namespace {

at::Tensor optional(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

// One packed matrix (runner/quantization.py), or one part of a fused matrix whose shards differ in layout.
struct PackedPart {
  at::Tensor codes, scales, offsets, super_scales;
  int64_t out_features;
};

// One Linear layer (layers.py): its weight, and its exact packed form when it has one.
struct LinearWeights {
  at::Tensor weight;
  std::vector<PackedPart> packed;  // empty: no packed form; several: outputs side by side (PackedParts)
  bool use_small_batch_kernel = false;
  int64_t max_quantized_rows = 0, max_small_batch_rows = 0;  // Linear.MAX_QUANTIZED_ROWS, MAX_KERNEL_ROWS
  bool int8_batch_activations = false;  // quantized_linear's
  bool invariant_dense = false;  // dense weights through dense_linear at every row count (batch invariance)

  // The Linear layer's dispatch: the quantized kernel for a few rows when packed, else dense_linear where
  // it is asked for, else the small-batch bf16 kernel for a few rows, else PyTorch's matmul.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& bias) const {
    at::Tensor y;
    if (!packed.empty() && x.size(0) <= max_quantized_rows) {
      std::vector<at::Tensor> outputs;
      for (const auto& p : packed)
        outputs.push_back(quantized_linear(x, p.codes, p.scales, p.offsets, p.super_scales, p.out_features,
                                          int8_batch_activations));
      y = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
    } else if (invariant_dense) {
      y = dense_linear(x, weight);
    } else if (use_small_batch_kernel && x.size(0) <= max_small_batch_rows) {
      y = bf16_linear_small_batch(x, weight);
    } else {
      return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
    return bias.defined() ? y.add(bias) : y;
  }

  // silu_mul(operator()(x)) of a SwiGLU gate_up matrix, bit for bit; a single packed matrix fuses the two
  // (quantized_swiglu).
  at::Tensor swiglu(const at::Tensor& x) const {
    if (packed.size() == 1 && x.size(0) <= max_quantized_rows) {
      const auto& p = packed[0];
      return quantized_swiglu(x, p.codes, p.scales, p.offsets, p.super_scales, p.out_features,
                              int8_batch_activations);
    }
    return silu_mul(operator()(x, at::Tensor()));
  }

  // residual += this layer's x @ W.T (+ bias), as residual.add_(operator()(x, bias)) adds it, bit for bit; a
  // single packed matrix adds each group's bf16 result as it completes (quantized_linear_add_), with no
  // result tensor and no pass over one.
  void add_to(at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias) const {
    if (packed.size() == 1 && !bias.defined() && x.size(0) <= max_quantized_rows) {
      const auto& p = packed[0];
      quantized_linear_add_(residual, x, p.codes, p.scales, p.offsets, p.super_scales, p.out_features,
                            int8_batch_activations);
      return;
    }
    residual.add_(operator()(x, bias));
  }
};

// t: [weight, then codes, scales, offsets, super_scales of each packed part]. Every part but the last has
// whole groups of 16 rows (PackedParts), so its row count is its codes' (groups, or rows of 16-bit weights).
LinearWeights linear_weights(const std::vector<at::Tensor>& t, int64_t max_quantized_rows,
                             int64_t max_small_batch_rows, bool int8_batch_activations, bool invariant_dense) {
  TORCH_CHECK(!t.empty() && (t.size() - 1) % 4 == 0, "a linear layer: its weight and 4 tensors per packed part");
  LinearWeights w{t[0]};
  int64_t rows_left = w.weight.size(0);
  for (size_t i = 1; i < t.size(); i += 4) {
    const bool last = i + 4 == t.size();
    const bool sixteen_bit = t[i].scalar_type() == at::kHalf || t[i].scalar_type() == at::kBFloat16;
    const int64_t rows = last ? rows_left : t[i].size(0) * (sixteen_bit ? 1 : 16);  // 16-bit: (N, K)
    w.packed.push_back({t[i], t[i + 1], optional(t[i + 2]), optional(t[i + 3]), rows});
    rows_left -= rows;
  }
  w.max_quantized_rows = max_quantized_rows;
  w.max_small_batch_rows = max_small_batch_rows;
  w.int8_batch_activations = int8_batch_activations;
  w.invariant_dense = invariant_dense && w.packed.empty();
  w.use_small_batch_kernel = w.weight.scalar_type() == at::kBFloat16 && w.weight.size(1) % 32 == 0;
  return w;
}

// A sparse layer's router and routed experts, as SparseMoe hands them to its kernels (runner/moe.py).
struct ExpertWeights {
  at::Tensor router, router_bias;  // (num_experts, hidden) fp32; (num_experts,) fp32 or undefined
  std::vector<at::Tensor> gate, up, down;  // the stacks' [codes, scales, offsets, super_scales]
  at::Tensor gate_bias, up_bias, down_bias;  // fp32 or empty
  int64_t num_experts = 0, inter = 0, top_k = 0, activation = 0;
  bool renormalize = false;
  double alpha = 0, limit = 0;
};

// t: [router, router_bias, 4 gate, 4 up, 4 down tensors, gate_bias, up_bias, down_bias]; p: [num_experts,
// inter, top_k, renormalize, activation, alpha, limit].
ExpertWeights expert_weights(const std::vector<at::Tensor>& t, const std::vector<double>& p) {
  TORCH_CHECK(t.size() == 17 && p.size() == 7, "a sparse layer: 17 tensors and 7 numbers");
  ExpertWeights e{t[0], optional(t[1]), {t[2], t[3], t[4], t[5]}, {t[6], t[7], t[8], t[9]},
                  {t[10], t[11], t[12], t[13]}, t[14], t[15], t[16]};
  e.num_experts = static_cast<int64_t>(p[0]);
  e.inter = static_cast<int64_t>(p[1]);
  e.top_k = static_cast<int64_t>(p[2]);
  e.renormalize = p[3] != 0;
  e.activation = static_cast<int64_t>(p[4]);
  e.alpha = p[5];
  e.limit = p[6];
  return e;
}

struct LayerWeights {
  at::Tensor input_norm, qkv_bias, q_norm, k_norm, post_norm;
  LinearWeights qkv, o, gate_up, down;  // gate_up and down: a dense layer's
  at::Tensor k_cache, v_cache;  // (num_slots, num_kv_heads, head_dim)
  int64_t window;  // paged_decode_attention's
  at::Tensor o_bias, sinks;  // undefined: none; sinks fp32, one per query head
  std::optional<ExpertWeights> experts;  // a sparse layer's
};

}  // namespace

class DecodeStack::Layers {
 public:
  // As DecodeStack takes them (decode_stack.h).
  Layers(const std::vector<std::vector<at::Tensor>>& layers,
         const std::vector<std::vector<std::vector<at::Tensor>>>& linears,
         const std::vector<std::vector<at::Tensor>>& experts, const std::vector<std::vector<double>>& expert_params,
         const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads,
         int64_t head_dim, int64_t block_size, double eps, double scale, int64_t max_quantized_rows,
         int64_t max_small_batch_rows, bool int8_batch_activations, bool invariant_dense)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size),
        eps_(eps), scale_(scale), int8_batch_activations_(int8_batch_activations) {
    TORCH_CHECK(layers.size() == linears.size() && layers.size() == windows.size() &&
                layers.size() == experts.size() && layers.size() == expert_params.size(),
                "per layer: its tensors, linear layers, experts and window");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      const bool sparse = !experts[i].empty();
      TORCH_CHECK(t.size() == 9 && linears[i].size() == (sparse ? 2u : 4u),
                  "each layer: 9 tensors and 4 linear layers (2 in a sparse layer)");
      auto linear = [&](size_t j) {
        if (j >= linears[i].size()) return LinearWeights{};
        return linear_weights(linears[i][j], max_quantized_rows, max_small_batch_rows, int8_batch_activations,
                              invariant_dense);
      };
      layers_.push_back({t[0], optional(t[1]), optional(t[2]), optional(t[3]), t[4], linear(0), linear(1),
                         linear(2), linear(3), t[5], t[6], windows[i], optional(t[7]), optional(t[8])});
      if (sparse) layers_.back().experts = expert_weights(experts[i], expert_params[i]);
    }
  }

  void forward(at::Tensor x, at::Tensor slot_mapping, at::Tensor block_tables,
               at::Tensor context_lens, at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: (rows, hidden) fp32");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == x.size(0),
                "one int64 slot per row");
    const auto slots = slot_mapping.contiguous();
    for (const auto& layer : layers_) {
      run_layer(layer, x, slots, block_tables, context_lens, cos, sin);
    }
  }

 private:
  void run_layer(const LayerWeights& w, at::Tensor& x, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& cos,
                 const at::Tensor& sin) const {
    const int64_t rows = x.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    auto qkv = w.qkv(rms_norm(x, w.input_norm, eps_), w.qkv_bias);
    auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    if (w.q_norm.defined()) {
      q = rms_norm(q.reshape({-1, head_dim_}), w.q_norm, eps_).view({rows, num_heads_, head_dim_});
      k = rms_norm(k.reshape({-1, head_dim_}), w.k_norm, eps_).view({rows, num_kv_heads_, head_dim_});
    }
    rotary_embedding_(q, k, cos, sin);
    write_kv(w, k, v, slots);
    const auto paged = std::vector<int64_t>{-1, block_size_, num_kv_heads_, head_dim_};
    auto attn = paged_decode_attention(q, w.k_cache.view(paged), w.v_cache.view(paged),
                                       block_tables, context_lens, scale_, w.window, w.sinks);
    w.o.add_to(x, attn.view({rows, q_size}), w.o_bias);
    const auto h = rms_norm(x, w.post_norm, eps_);
    if (w.experts) {
      x.add_(run_experts(*w.experts, h));
      return;
    }
    const at::Tensor no_bias;
    w.down.add_to(x, w.gate_up.swiglu(h), no_bias);
  }

  // SparseMoe.forward with its native kernels: softmax over the router's logits, the top k by a stable sort
  // (ties to the lower id), renormalized when the family says, then the experts.
  at::Tensor run_experts(const ExpertWeights& e, const at::Tensor& h) const {
    auto logits = router_logits(h, e.router);
    if (e.router_bias.defined()) logits = logits.add(e.router_bias);
    const auto probs = at::softmax(logits, -1);
    const auto [sorted, order] = at::sort(probs, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
    auto weights = sorted.narrow(1, 0, e.top_k);
    const auto ids = order.narrow(1, 0, e.top_k);
    if (e.renormalize) weights = weights.div(weights.sum(-1, /*keepdim=*/true));
    return moe_experts(h, ids, weights, e.gate, e.up, e.down, e.gate_bias, e.up_bias, e.down_bias, e.num_experts,
                       e.inter, h.size(1), e.activation, e.alpha, e.limit, int8_batch_activations_);
  }

  // The new tokens' K and V rows into their cache slots, in the cache's dtype (an 8-bit cache: rounded).
  void write_kv(const LayerWeights& w, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) const {
    store_cache_rows(k, w.k_cache, slots);
    store_cache_rows(v, w.v_cache, slots);
  }

  std::vector<LayerWeights> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_, block_size_;
  double eps_, scale_;
  bool int8_batch_activations_;
};

DecodeStack::DecodeStack(const std::vector<std::vector<at::Tensor>>& layers,
                         const std::vector<std::vector<std::vector<at::Tensor>>>& linears,
                         const std::vector<std::vector<at::Tensor>>& experts,
                         const std::vector<std::vector<double>>& expert_params,
                         const std::vector<int64_t>& windows, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps, double scale,
                         int64_t max_quantized_rows, int64_t max_small_batch_rows, bool int8_batch_activations,
                         bool invariant_dense)
    : layers_(std::make_shared<Layers>(layers, linears, experts, expert_params, windows, num_heads, num_kv_heads, head_dim, block_size, eps, scale,
                                       max_quantized_rows, max_small_batch_rows, int8_batch_activations,
                                       invariant_dense)) {}

void DecodeStack::forward(at::Tensor x, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor context_lens,
                          at::Tensor cos, at::Tensor sin) {
  layers_->forward(x, slot_mapping, block_tables, context_lens, cos, sin);
}
