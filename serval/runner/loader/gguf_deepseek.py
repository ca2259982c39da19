"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, V2-Lite, V3, Kimi-K2) as DeepSeek's Hugging Face config
keys and weights.

llama.cpp's converter writes MLA's shapes as attention.{q,kv}_lora_rank, key/value_length(_mla), the dense
lead as leading_dense_block_count, the experts as expert_{shared_count, weights_scale, weights_norm,
gating_func} (V3's sigmoid router adds exp_probs_b, its correction bias), and YaRN's mscale as
rope.scaling.yarn_log_multiplier (0.1 mscale_all_dim); its gating function (softmax or sigmoid) says V2 or V3.
Newer files split kv_b_proj into attn_k_b and attn_v_b (gguf_names.py names them a head at a time,
models/deepseek.py joins them). RoPE needs no row permutation: the checkpoint's pairs are what llama.cpp
rotates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# llama.cpp's LLM_EXPERT_GATING_FUNC_TYPE
_SIGMOID_GATING = 2


def deepseek2_config(metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config.json keys of a deepseek2 file (its metadata, decoded) beyond the common ones."""

    def value(key: str, default: Any) -> Any:
        return metadata.get(f"deepseek2.{key}", default)

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
    if value("expert_count", 0):
        # The experts' keys are read as every family's (gguf.py's _moe_config); what deepseek2 decides itself:
        # no renormalization unless the file says so (llama.cpp's default), and the kind of group ranking.
        config["norm_topk_prob"] = bool(value("expert_weights_norm", False))
        grouped = "noaux_tc" if is_v3 else "group_limited_greedy"  # top-2 sum, or best score, per group
        config["topk_method"] = grouped if int(value("expert_group_count", 1)) > 1 else "greedy"
    return config


def yarn_mscale_keys(log_multiplier: float | None) -> dict[str, float]:
    """YaRN's mscale keys from rope.scaling.yarn_log_multiplier. llama.cpp scales the logits by
    (1 + log_multiplier ln(factor))^2 and leaves the rotary tables unscaled: mscale = mscale_all_dim in HF's
    terms (DeepSeek's configs give them equal)."""
    if not log_multiplier:
        return {}
    mscale = float(str(np.float32(log_multiplier))) / 0.1  # the float32 as written (0.0707, not 0.07069...)
    return {"mscale": mscale, "mscale_all_dim": mscale}
