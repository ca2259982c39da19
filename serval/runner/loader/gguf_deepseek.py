"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, V2-Lite, V3, Kimi-K2) as DeepSeek's Hugging Face config
keys and weights.

llama.cpp's converter writes MLA's shapes as attention.{q,kv}_lora_rank, key/value_length(_mla), the dense
lead as leading_dense_block_count, the experts as expert_{shared_count, weights_scale, weights_norm,
gating_func} (V3's sigmoid router adds exp_probs_b, its correction bias), and YaRN's mscale as
rope.scaling.yarn_log_multiplier (0.1 mscale_all_dim). Newer files split kv_b_proj into attn_k_b (each head's
W_UK transposed) and attn_v_b; they are joined back here. RoPE needs no row permutation: the checkpoint's
pairs are what llama.cpp rotates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# llama.cpp's LLM_EXPERT_GATING_FUNC_TYPE
_SIGMOID_GATING = 2
# The two halves of a split kv_b_proj, by their Hugging Face stand-in names (gguf_names.py).
SPLIT_KV_B_PARTS = ("attn_k_b", "attn_v_b")


def deepseek2_config(value: Callable[[str, Any], Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config.json keys of a deepseek2 file beyond the common ones; value(key, default) reads
    `deepseek2.{key}`."""
    rope_dim = int(value("rope.dimension_count", 64))
    kv_lora_rank = int(value("attention.kv_lora_rank", 512))
    # Files since MLA's absorbed form write key_length = the latent's and key_length_mla = a head's q.k width.
    key_length = value("attention.key_length_mla", None) or value("attention.key_length", None)
    value_length = value("attention.value_length_mla", None) or value("attention.value_length", None)
    is_v3 = value("expert_gating_func", 1) == _SIGMOID_GATING or any("exp_probs_b" in n for n in tensor_names)
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if is_v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if is_v3 else "deepseek_v2",
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": value("attention.q_lora_rank", None) or None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": int(key_length) - rope_dim,
        "v_head_dim": int(value_length),
        "first_k_dense_replace": int(value("leading_dense_block_count", 0)),
    }
    num_experts = value("expert_count", 0)
    if num_experts:
        config |= {
            "n_routed_experts": int(num_experts),
            "n_shared_experts": int(value("expert_shared_count", 0)),
            "routed_scaling_factor": float(value("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(value("expert_weights_norm", False)),
            "n_group": int(value("expert_group_count", 1)),
            "topk_group": int(value("expert_group_used_count", 1)),
        }
        # V3's groups are ranked by their top-2 sum (noaux_tc), V2's by their best score
        grouped = "noaux_tc" if is_v3 else "group_limited_greedy"
        config["topk_method"] = grouped if config["n_group"] > 1 else "greedy"
    return config


def yarn_mscale_keys(log_multiplier: float | None) -> dict[str, float]:
    """YaRN's mscale keys from rope.scaling.yarn_log_multiplier. llama.cpp scales the logits by
    (1 + log_multiplier ln(factor))^2 and leaves the rotary tables unscaled: mscale = mscale_all_dim in HF's
    terms (DeepSeek's configs give them equal)."""
    if not log_multiplier:
        return {}
    mscale = float(log_multiplier) / 0.1
    return {"mscale": mscale, "mscale_all_dim": mscale}


class KvBJoiner:
    """Joins a layer's attn_k_b ((heads, kv_lora_rank, qk_nope): W_UK transposed) and attn_v_b ((heads,
    v_head, kv_lora_rank)) back into kv_b_proj's (heads * (qk_nope + v_head), kv_lora_rank) rows, whichever
    comes first."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[str, torch.Tensor]] = {}

    def add(self, hf_name: str, part: str, weight: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        target = hf_name.rsplit(".", 2)[0] + ".kv_b_proj.weight"  # model.layers.N.self_attn.kv_b_proj.weight
        other = self.pending.pop(target, None)
        if other is None:
            self.pending[target] = (part, weight)
            return None
        halves = dict([other, (part, weight)])
        w_uk, w_uv = halves["attn_k_b"].transpose(1, 2), halves["attn_v_b"]
        joined = torch.cat([w_uk, w_uv], dim=1)  # (heads, qk_nope + v_head, kv_lora_rank)
        return target, joined.reshape(-1, joined.shape[-1]).contiguous()
