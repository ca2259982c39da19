"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), their mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE: runner/moe.py), gpt-oss (biases, attention sinks, sliding windows, YaRN, a
clamped SwiGLU) and MiniMax-M2 (q/k norms over all heads, partial RoPE, sigmoid routing). GLM-4/4.5 and
DeepSeek subclass it (models/glm.py, models/deepseek.py). They differ in flags of ArchConfig; weights arrive
with Hugging Face names and are packed into fused q/k/v, gate/up and stacked expert matrices as they load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from serval.runner.attention.backend import KvCacheSpec, StepAttention, paged_attention
from serval.runner.kernels import packed_rows_limit, quantized_matmul
from serval.runner.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RopeTables,
    RotaryEmbedding,
    packed_logits,
    rope_attention_factor,
    rope_inverse_frequencies,
    small_batch_linear,
    takes_dense_kernel,
)
from serval.runner.models.arch import ArchConfig
from serval.runner.models.decode_stack import make_decode_stack
from serval.runner.moe import SparseMoe, expert_shards, expert_weight_target, split_fused_experts

if TYPE_CHECKING:
    from serval.runner.lora import LoraBatch


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, index: int):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        # per head, or (MiniMax-M2) over all the heads' dims at once
        self.norms_all_heads = arch.qk_norm_over_heads
        q_width, k_width = (
            (self.q_size, self.kv_size) if self.norms_all_heads else (self.head_dim, self.head_dim)
        )
        self.q_norm = RMSNorm(q_width, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_width, arch.rms_norm_eps) if arch.qk_norm else None
        self.window = arch.sliding_window if index in arch.sliding_layers else 0
        self.sinks = nn.Parameter(torch.zeros(arch.num_heads)) if arch.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size)
        rope: RopeTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepAttention,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norms_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norms_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        # The kernels take the sinks in fp32 whatever the compute dtype (a softmax logit, not a weight).
        sinks = None if self.sinks is None else self.sinks.float()
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window, sinks)
        return self.o_proj(out.reshape(num_tokens, self.q_size), lora)


class DecoderLayer(nn.Module):
    fits_decode_stack = True  # kernels.DecodeStack computes this block (models/decode_stack.py)
    attention_class = Attention  # a family with another attention (DeepSeek's latent one) swaps it

    def __init__(self, arch: ArchConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self.attention_class(arch, index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.moe is not None and arch.moe.is_sparse(index):
            self.mlp = SparseMoe(arch.hidden_size, arch.moe)
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)
        # Tensor parallelism (runner/parallel/): sums each block half's partial output over the ranks.
        self.all_reduce = None

    def forward(self, x, rope, k_cache, v_cache, meta, lora=None):
        # x is the residual stream, kept in fp32: these models carry outlier activations in the tens of
        # thousands (attention sinks), where bf16's 8-bit mantissa loses whole units and greedy output drifts.
        x = x.add_(self._reduced(self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta, lora)))
        return x.add_(self._reduced(self.mlp(self.post_attention_layernorm(x), lora)))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:
            return partial
        # Summed in fp32, as the residual stream it joins: a bf16 sum would round each rank's share.
        total = partial.float()
        self.all_reduce(total)
        return total


# Hugging Face parameter suffix -> (our fused parameter, which shard of it).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    # a family with other blocks (GLM-4's extra norms: models/glm.py; DeepSeek's MLA: models/deepseek.py)
    layer_class = DecoderLayer

    @staticmethod
    def kv_cache_spec(arch: ArchConfig) -> KvCacheSpec:
        """What each layer caches a token (the runner allocates it): a K and a V row per KV head."""
        return KvCacheSpec(arch.num_kv_heads, arch.head_dim)

    def __init__(self, arch: ArchConfig, max_positions: int):
        super().__init__()
        self.arch = arch
        # Given its (uninitialized) weight: the checkpoint overwrites it, and nn.Embedding's own random init
        # on the meta device goes through torch's Python refs, whose first use imports torch._dynamo (~2 s
        # of every start).
        self.embed_tokens = nn.Embedding(
            arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size)
        )
        self.layers = nn.ModuleList(self.layer_class(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        has_own_head = arch.has_lm_head and not arch.tie_word_embeddings
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, False) if has_own_head else None
        self.max_positions = max_positions
        self.rotary = self._make_rotary(None)
        # The tied head's exact packed form (runner/quantization.py), set by the loader when it has one.
        self.packed_tied_head = None
        # The embedding's packed form when its dense copy was released (runner/quantization.py): look-ups
        # dequantize the rows they need.
        self.packed_embedding = None
        # The native kernels' parts, None until use_kernels: the tied head's dense, bf16 and packed matmuls,
        # and kernels.DecodeStack over every layer (decode-only steps without adapters run all layers in one
        # call).
        self.tied_head_kernel = None
        self.tied_head_dense_kernel = None
        self.tied_head_quantized_kernel = None
        self.tied_head_max_quantized_rows = 0
        self.decode_stack = None

    def _make_rotary(self, freq_factors: torch.Tensor | None) -> RotaryEmbedding:
        arch = self.arch
        inv_freq = rope_inverse_frequencies(arch.rope_dim, arch.rope_theta, arch.rope_scaling, freq_factors)
        return RotaryEmbedding(
            arch.head_dim,
            self.max_positions,
            inv_freq,
            rope_attention_factor(arch.rope_scaling),
            interleaved=arch.rope_interleaved,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        logit_rows: torch.Tensor,  # (num_rows,) which tokens need logits (Batch.logit_rows)
        lora: LoraBatch | None = None,  # which tokens use which adapter; None: the base model for all
    ) -> torch.Tensor:  # (num_rows, vocab_size) float32
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, self.embed_tokens.weight.dtype)
        return self.forward_embedded(x, rope, kv_caches, meta, logit_rows, lora)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (num_tokens, hidden_size) float32
        if self.packed_embedding is not None:
            return self.packed_embedding.rows(input_ids)  # the fp32 residual stream
        return self.embed_tokens(input_ids).float()

    def forward_embedded(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size) float32 input rows (a multimodal model's: spliced)
        rope: RopeTables,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        logit_rows: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # (num_rows, vocab_size) float32
        x = self.norm(self.run_layers(x, rope, kv_caches, meta, lora)[logit_rows])
        head = self.lm_head
        if head is not None:
            logits = packed_logits(x, head.packed, head.quantized_kernel, head.max_quantized_rows, head.bias)
            return head(x).float() if logits is None else logits
        weight = self.embed_tokens.weight
        packed = self.packed_tied_head, self.tied_head_quantized_kernel, self.tied_head_max_quantized_rows
        logits = packed_logits(x, *packed)
        if logits is None:
            logits = small_batch_linear(
                x, weight, self.tied_head_kernel, *packed, self.tied_head_dense_kernel
            )
        return (x @ weight.t() if logits is None else logits).float()

    def run_layers(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size) float32
        rope: RopeTables,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # (num_tokens, hidden_size) float32: the last layer's output, before the final norm
        fused = None if self.decode_stack is None or lora is not None else meta.fused_decode
        if fused is not None:
            self.decode_stack.forward(
                x, fused.slot_mapping, fused.block_tables, fused.context_lens, rope.cos, rope.sin
            )
            return x
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, rope, k_cache, v_cache, meta, lora)
        return x

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
    ) -> torch.Tensor:  # (num_tokens, hidden_size) float32: every token's final (normed) hidden state
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, self.embed_tokens.weight.dtype)
        return self.norm(self.run_layers(x, rope, kv_caches, meta)).float()

    def use_kernels(
        self,
        kernels,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        dtype: torch.dtype,
        int8_batch_activations: bool = False,
        deterministic: bool = False,
        invariant_dense: bool = True,
    ) -> None:
        """Run on the native CPU kernels once the weights are loaded (the runner calls it after
        layers.use_native_kernels, with the same int8_batch_activations, deterministic and invariant_dense):
        the tied head's matmuls and a DecodeStack over these caches."""
        if dtype == torch.bfloat16:
            self.tied_head_kernel = kernels.bf16_linear_small_batch
        weight = self.embed_tokens.weight
        dense = (
            invariant_dense and self.packed_tied_head is None and takes_dense_kernel(weight, deterministic)
        )
        self.tied_head_dense_kernel = kernels.dense_linear if dense else None
        # The layers' dense matrices are in the compute dtype: the stack takes one choice for all of them.
        invariant_dense = invariant_dense and takes_dense_kernel(torch.empty(0, dtype=dtype), deterministic)
        if self.packed_tied_head is not None:
            self.tied_head_quantized_kernel = quantized_matmul(kernels, int8_batch_activations)
            self.tied_head_max_quantized_rows = packed_rows_limit(kernels)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.use_kernels(kernels, int8_batch_activations, deterministic)
        self.decode_stack = make_decode_stack(
            self, kernels, kv_caches, block_size, int8_batch_activations, invariant_dense
        )

    def use_tensor_parallel(self, all_reduce) -> None:
        """Run as one rank of a split model (runner/parallel/): this model holds the rank's heads and MLP
        slice, and each block half's output is all-reduced. NOTE: the native DecodeStack runs every layer in
        one call, with no point to all-reduce in between, so decode steps take the per-layer path."""
        for layer in self.layers:
            layer.all_reduce = all_reduce
        self.decode_stack = None

    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        """Where a checkpoint tensor goes: (our parameter's name, shard of a fused matrix or None), or None
        for tensors that are not parameters (recomputed or redundant ones)."""
        name = hf_name.removeprefix("model.")
        if name == "rotary_emb.freq_factors" or "rotary_emb.inv_freq" in name:
            return None
        if self.lm_head is None and name == "lm_head.weight":
            return None  # some tied checkpoints still carry a copy; an embedding model's is never used
        if self.arch.moe is not None:
            target = expert_weight_target(name, self.arch.moe.num_experts)
            if target is not None:
                return target
        for suffix, (fused, index) in _FUSED.items():
            if f".{suffix}." in f".{name}":
                return name.replace(suffix, fused), index
        return name, None

    def num_shards(self, parameter: str) -> int:
        """How many checkpoint tensors make up one of our parameters (q/k/v and gate/up are fused, and each
        of the experts' projections is stacked over the experts)."""
        experts = self._expert_shards(parameter)
        if experts is not None:
            return experts[0]
        shards = [index for fused, index in _FUSED.values() if parameter.endswith(f"{fused}.weight")]
        return max(shards) + 1 if shards else 1

    def _materialized(self, target: str, param: torch.Tensor) -> torch.Tensor:
        # Matrices are left on the meta device by the loader until their first tensor arrives.
        module_name, attribute = target.rsplit(".", 1)
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad)
        setattr(self.get_submodule(module_name), attribute, real)
        return real

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Names only: a parameter is looked up when its tensor arrives, since the loader may swap a finished
        # matrix for a placeholder meanwhile (a dict of the parameters would keep every dense copy alive).
        params = {name for name, _ in self.named_parameters()}
        loaded: set[str] = set()
        for hf_name, tensor in self._per_expert(weights):
            if hf_name.removeprefix("model.") == "rotary_emb.freq_factors":
                self.rotary = self._make_rotary(tensor).to(self.embed_tokens.weight.device)
                continue
            found = self.weight_target(hf_name)
            if found is None:
                continue
            target, shard = found
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
            param = self.get_parameter(target)
            if param.is_meta:
                param = self._materialized(target, param)
            if shard is not None:
                start, size = self.shard_range(target, shard)
                param = param.narrow(0, start, size)
            with torch.no_grad():
                _copy_checked(param, tensor, hf_name)
            loaded.add(f"{target}#{shard}")
        self._check_all_loaded(loaded)

    def lora_layout(self) -> dict[str, tuple[str, int, int]]:
        """The modules a LoRA adapter may target, by their Hugging Face suffix within a decoder layer (as
        PEFT names them) -> (our Linear, first output row, rows): q/k/v and gate/up are row ranges of the
        fused matrices."""
        layout = {
            "self_attn.o_proj": ("self_attn.o_proj", 0, self.arch.hidden_size),
            "mlp.down_proj": ("mlp.down_proj", 0, self.arch.hidden_size),
        }
        for suffix, (fused, shard) in _FUSED.items():
            layout[suffix] = (fused, *self.shard_range(fused, shard))
        if self.arch.moe is not None:  # NOTE: adapters of experts are not served; attention's are
            layout = {suffix: target for suffix, target in layout.items() if suffix.startswith("self_attn.")}
        return layout

    def shard_range(self, fused_name: str, shard: int) -> tuple[int, int]:
        arch = self.arch
        weight_name = fused_name[: -len(".bias")] + ".weight" if fused_name.endswith(".bias") else fused_name
        experts = self._expert_shards(weight_name)  # a stacked bias has its weight's rows
        if experts is not None:
            return shard * experts[1], experts[1]
        if "qkv_proj" in fused_name:
            q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return shard * arch.intermediate_size, arch.intermediate_size

    def _expert_shards(self, parameter: str) -> tuple[int, int] | None:
        moe = self.arch.moe
        return None if moe is None else expert_shards(parameter, self.arch.hidden_size, moe)

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        # A state dict of transformers 5 holds each layer's experts in 3-D tensors; checkpoints hold one
        # tensor per expert and projection, which is what the stacked matrices are fused from.
        for name, tensor in weights:
            moe = self.arch.moe
            split = None if moe is None else split_fused_experts(name, tensor, moe.interleaved_gate_up)
            yield from [(name, tensor)] if split is None else split

    def _check_all_loaded(self, loaded: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            shards = self.num_shards(name.replace(".bias", ".weight"))  # a fused bias has the same shards
            if shards > 1:
                expected.update(f"{name}#{i}" for i in range(shards))
            else:
                expected.add(f"{name}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if src.is_meta:  # a matrix run from its packed form alone: dst is its placeholder, nothing to copy
        if dst.stride() != (0, 0):
            raise RuntimeError(f"weight {name!r} came without values for a dense parameter")
        return
    dst.copy_(src)
