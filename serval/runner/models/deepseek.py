"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, a DeepSeek-V3): Llama's decoder with multi-head latent attention
(runner/mla.py) and, past the first `first_k_dense_replace` layers, sparse MLPs with shared experts
(runner/moe.py).

Everything but the layers' attention is LlamaForCausalLM's (embedding, head, loading); the paged cache keeps
one latent row a token per layer (kv_cache_spec), which the runner allocates as one tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from serval.runner.attention.backend import KvCacheSpec
from serval.runner.mla import LatentAttention
from serval.runner.models.arch import ArchConfig
from serval.runner.models.llama import DecoderLayer, LlamaForCausalLM

_LAYER = re.compile(r"layers\.(\d+)\.")
# A GGUF's split kv_b_proj, a matrix a head (loader/gguf_names.py): attn_k_b.H (kv_lora_rank, qk_nope), head
# H's W_UK transposed, and attn_v_b.H (v_head, kv_lora_rank)
_SPLIT_KV_B = re.compile(r"(?P<attn>.*\.self_attn)\.attn_(?P<part>[kv])_b\.(?P<head>\d+)\.weight")


class DeepseekDecoderLayer(DecoderLayer):
    fits_decode_stack = False  # the native DecodeStack runs Llama's attention: decodes go layer by layer
    attention_class = LatentAttention  # NOTE: never split (Runner.check_can_split refuses MLA)

    def forward(self, x, rope, k_cache, v_cache, meta, lora=None):
        # k_cache is v_cache: the layer's one latent cache
        x = x.add_(self.self_attn(self.input_layernorm(x), rope, k_cache, meta, lora))
        return x.add_(self.mlp(self.post_attention_layernorm(x), lora))


class DeepseekForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer

    @staticmethod
    def kv_cache_spec(arch: ArchConfig) -> KvCacheSpec:
        """One row a token: [c_kv, roped key], its first kv_lora_rank values the value."""
        return KvCacheSpec(1, arch.mla.latent_dim, latent_value_dim=arch.mla.kv_lora_rank)

    def use_kernels(
        self, kernels, kv_caches, block_size, dtype, int8_batch_activations=False, **options
    ) -> None:
        """Llama's, and each layer's latent attention on kernels.dense_linear_heads."""
        super().use_kernels(kernels, kv_caches, block_size, dtype, int8_batch_activations, **options)
        for layer in self.layers:
            layer.self_attn.use_kernels(kernels)

    def lora_layout(self) -> dict[str, tuple[str, int, int]]:
        # NOTE: refused at start-up rather than half served: Llama's layout names fused q/k/v rows MLA lacks.
        raise ValueError(f"LoRA adapters are not supported for {self.arch.architecture} (latent attention)")

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return super()._per_expert(_joined_kv_b(weights, self.arch.num_heads))

    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("model.")
        layer = _LAYER.match(name)
        if layer is not None and int(layer[1]) >= self.arch.num_layers:
            return None  # V3's multi-token-prediction layers (num_nextn_predict_layers) are not run
        if ".self_attn." in name:
            return name, None  # no fused q/k/v: MLA's projections are loaded as they are
        return super().weight_target(name)


def _joined_kv_b(
    weights: Iterable[tuple[str, torch.Tensor]], num_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, with a split kv_b_proj's per-head halves joined back into kv_b_proj (each head's rows
    [W_UK; W_UV], as a checkpoint holds them) once all of a layer's have come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _SPLIT_KV_B.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        halves = pending.setdefault(match["attn"], {})
        halves[match["part"] + match["head"]] = tensor
        if len(halves) == 2 * num_heads:
            rows = [torch.cat([halves[f"k{h}"].t(), halves[f"v{h}"]]) for h in range(num_heads)]
            yield f"{match['attn']}.kv_b_proj.weight", torch.cat(rows)
            del pending[match["attn"]]
