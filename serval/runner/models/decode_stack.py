"""The native DecodeStack's view of a Llama-family model (kernels/decode_stack.cpp): every layer's weights,
packed forms, caches and attention facts in the lists its constructor takes.

The stack computes what the model's layers compute with the native kernels, bit for bit, so it is built only
where every layer is one it runs (whole-head neox RoPE, per-head q/k norms, Llama's block with no extra
norms): dense MLPs, and sparse layers whose experts and router take the native kernels (kernels/moe.cpp)
with no shared expert and a plain softmax router (MoeArch.has_plain_routing).
"""

from __future__ import annotations

import torch

from serval.runner.kernels import packed_rows_limit
from serval.runner.layers import Linear
from serval.runner.moe import ACTIVATIONS, SparseMoe


def _linear(module: Linear) -> list[torch.Tensor]:
    packed = module.packed if module.quantized_kernel is not None else None
    parts = [] if packed is None else packed.parts
    return [module.weight, *(t for p in parts for t in (p.codes, p.scales, p.offsets, p.super_scales))]


def _runs_natively(mlp) -> bool:
    if not isinstance(mlp, SparseMoe):
        return True
    return (
        mlp.native_kernel is not None
        and mlp.router_kernel is not None
        and mlp.shared_expert is None
        and mlp.shared_experts is None
        and mlp.has_plain_routing  # the stack's router is a softmax over all experts
    )


def _experts(mlp: SparseMoe) -> tuple[list[torch.Tensor], list[float]]:
    none = torch.empty(0)
    bias = mlp.gate.bias
    tensors = [
        mlp.router_weight,
        none if bias is None else bias.detach().float().contiguous(),
        *(t for stack in mlp.native_parts for t in stack),
        *mlp.native_biases,
    ]
    e = mlp.experts
    params = [e.num_experts, e.inter, mlp.top_k, float(mlp.renormalize), ACTIVATIONS[mlp.activation]]
    return tensors, [float(p) for p in params] + [mlp.alpha, mlp.limit]


def make_decode_stack(
    model,
    kernels,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    int8: bool,
    invariant_dense: bool = True,
):
    """kernels.DecodeStack over the model's layers and these caches, or None when a layer is one the stack
    does not run (see the module's docstring): such models decode layer by layer. invariant_dense: dense
    weights through kernels.dense_linear, as layers.use_native_kernels sets them."""
    arch = model.arch
    if arch.rotary_dim or arch.rope_interleaved or arch.qk_norm_over_heads:
        return None  # the stack turns whole heads' halves and norms q/k per head
    if not all(layer.fits_decode_stack and _runs_natively(layer.mlp) for layer in model.layers):
        return None
    none = torch.empty(0)
    layers, linears, experts, expert_params = [], [], [], []
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_bias, o_bias = attn.qkv_proj.bias, attn.o_proj.bias
        layers.append(
            [
                layer.input_layernorm.weight,
                none if qkv_bias is None else qkv_bias,
                none if attn.q_norm is None else attn.q_norm.weight,
                none if attn.k_norm is None else attn.k_norm.weight,
                layer.post_attention_layernorm.weight,
                k_cache,
                v_cache,
                none if o_bias is None else o_bias,
                none if attn.sinks is None else attn.sinks.detach().float().contiguous(),
            ]
        )
        if isinstance(mlp, SparseMoe):
            linears.append([_linear(attn.qkv_proj), _linear(attn.o_proj)])
            tensors, params = _experts(mlp)
        else:
            linears.append(
                [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            )
            tensors, params = [], []
        experts.append(tensors)
        expert_params.append(params)
    windows = [layer.self_attn.window for layer in model.layers]
    return kernels.DecodeStack(
        layers, linears, experts, expert_params, windows, arch.num_heads, arch.num_kv_heads, arch.head_dim,
        block_size, arch.rms_norm_eps, model.layers[0].self_attn.scale, packed_rows_limit(kernels),
        Linear.MAX_KERNEL_ROWS, int8, invariant_dense,
    )  # fmt: skip
