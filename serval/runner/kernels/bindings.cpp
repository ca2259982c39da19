// The Python module: binds every source's kernels and the decode stack. The one file that includes torch's
// Python headers (pybind11 and the tensor type casters): they cost ~15 s of compiling per file, the kernels'
// ATen headers ~4 s, and every variant compiles every file.
#include <torch/python.h>
#include "common.h"
#include "decode_stack.h"

#define SERVAL_STRINGIFY_(x) #x
#define SERVAL_STRINGIFY(x) SERVAL_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel releases the GIL while it runs: the engine thread computes while the event loop serves.
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("bf16_linear_small_batch", &bf16_linear_small_batch, "x @ w.T for a few rows, bf16", release());
  m.def("dense_linear", &dense_linear, "x @ w.T for dense weights, a row's bits the same at any row count",
        release());
  m.def("dense_linear_heads", &dense_linear_heads, "dense_linear over (heads, M, K) x and (heads, N, K) w at once",
        release());
  // Which instruction-set variant this build is (kernels/__init__.py compiles one module per variant).
  m.attr("variant") = SERVAL_STRINGIFY(SERVAL_VARIANT);
  m.def("rms_norm", &rms_norm, "RMSNorm in fp32, output in the weight's dtype", release());
  m.def("argmax_rows", &argmax_rows, "each row's torch.argmax of (rows, n) fp32", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (rows, 2 * inter) tensor", release());
  m.def("rotary_embedding_", &rotary_embedding_, "neox RoPE in place on q and k", release());
  m.def("store_cache_rows", &store_cache_rows, "rows into their KV cache slots, in the cache's dtype", release());
  // window 0: every query sees its whole context; sinks empty: no sink logits. value_dim 0: head_dim; less:
  // MLA's latent attention (values the first value_dim of each V row; the output that wide, prefill's `out` too).
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache (one query token per sequence)", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("sinks") = at::empty({0}, at::kFloat), pybind11::arg("value_dim") = 0, release());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefilling sequences over the paged KV cache, written into out", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("query_starts"), pybind11::arg("query_lens"), pybind11::arg("context_lens"),
        pybind11::arg("scale"), pybind11::arg("out"), pybind11::arg("window") = 0,
        pybind11::arg("sinks") = at::empty({0}, at::kFloat), release());
  m.def("quantized_linear", &quantized_linear, "x @ w.T with w in packed 4-bit or 8-bit blocks", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("super_scales"),
        pybind11::arg("N"), pybind11::arg("int8_batch_activations") = false, release());
  m.def("quantized_linear_add_", &quantized_linear_add_, "residual += quantized_linear(x, ...), in place",
        pybind11::arg("residual"), pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("offsets"), pybind11::arg("super_scales"), pybind11::arg("N"),
        pybind11::arg("int8_batch_activations") = false, release());
  m.def("quantized_swiglu", &quantized_swiglu, "silu_mul(quantized_linear(x, ...)) of a SwiGLU gate_up matrix",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("offsets"),
        pybind11::arg("super_scales"), pybind11::arg("N"), pybind11::arg("int8_batch_activations") = false,
        release());
  // From how many rows int8_batch_activations takes int8 x (0: never in this build).
  m.attr("int8_rows_from") = int8_rows_from();
  m.def("int8_tile_rows", &int8_tile_rows, "16 where the int8 path takes whole tiles of rows through AMX, else 0");
  m.def("moe_experts", &moe_experts,
        "a sparse MoE layer's routed experts (tokens grouped by expert, experts in parallel) over packed stacks",
        release());
  m.def("router_logits", &router_logits, "a MoE router's logits, the same bits whatever the batch", release());
  m.def("pack_gguf_blocks", &pack_gguf_blocks, "a GGUF block-quantized matrix's bytes, packed", release());
  m.def("gguf_packed_buffers", &gguf_packed_buffers, "the empty packed buffers of a GGUF type's matrix", release());
  m.def("pack_gguf_blocks_into", &pack_gguf_blocks_into,
        "a GGUF block-quantized matrix's bytes, packed into given buffers from a group on", release());
  // module_local: each variant's module binds its own DecodeStack, and a process can load several (the tests).
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<const std::vector<std::vector<at::Tensor>>&,
                          const std::vector<std::vector<std::vector<at::Tensor>>>&,
                          const std::vector<std::vector<at::Tensor>>&, const std::vector<std::vector<double>>&,
                          const std::vector<int64_t>&,
                          int64_t, int64_t, int64_t,
                          int64_t, double, double, int64_t, int64_t, bool, bool>())
      .def("forward", &DecodeStack::forward, "every decoder layer of a decode-only step, in place on x", release());
}
