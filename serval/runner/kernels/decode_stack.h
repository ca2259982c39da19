// The handle of a decode-only step's layers (decode_stack.cpp): what the Python module (bindings.cpp) needs
// to bind it, so that only that one file compiles pybind11 and torch's Python headers.
#pragma once
#include <ATen/core/Tensor.h>
#include <memory>
#include <vector>

class DecodeStack {
 public:
  // layers: per layer [input_norm, qkv_bias, q_norm, k_norm, post_norm, k_cache, v_cache] (an empty tensor
  // stands for an absent bias or q/k norm), and linears: per layer the tensors of qkv, o, gate_up and down,
  // each [weight, then codes, scales, offsets, super_scales of each packed part]; layers also end with
  // [o_bias, sinks] (empty: none). A sparse layer has only qkv and o among its linears, and its experts
  // [router, router_bias, the gate, up and down stacks' 4 tensors each, their 3 biases] with expert_params
  // [num_experts, inter, top_k, renormalize, activation, alpha, limit]; a dense layer's are empty. windows:
  // per layer, the positions a query sees (0: its whole context; sliding-window layers).
  DecodeStack(const std::vector<std::vector<at::Tensor>>& layers,
              const std::vector<std::vector<std::vector<at::Tensor>>>& linears,
              const std::vector<std::vector<at::Tensor>>& experts,
              const std::vector<std::vector<double>>& expert_params,
              const std::vector<int64_t>& windows, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps, double scale,
              int64_t max_quantized_rows, int64_t max_small_batch_rows, bool int8_batch_activations,
              bool invariant_dense);

  // x: (num_seqs, hidden) fp32 residual stream, updated in place. slot_mapping (num_seqs,): where each
  // sequence's new K/V go; block_tables (num_seqs, max_blocks) and context_lens (num_seqs,) int64, as the
  // decode attention kernel takes them; cos, sin (num_seqs, head_dim / 2) fp32 at each new token's position.
  void forward(at::Tensor x, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor context_lens,
               at::Tensor cos, at::Tensor sin);

 private:
  class Layers;  // decode_stack.cpp
  std::shared_ptr<Layers> layers_;
};
