"""llama.cpp's tensor names as Hugging Face's: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`,
and a 3-D `blk.N.ffn_gate_exps.weight` -> one `model.layers.N.mlp.experts.E.gate_proj.weight` per expert.
"""

from __future__ import annotations

import re
from types import MappingProxyType

_GLOBAL_NAMES: MappingProxyType[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        # Llama 3.1's rope scaling, baked by the converter into one factor per rotary frequency
        "rope_freqs.weight": "model.rotary_emb.freq_factors",
    }
)
_LAYER_NAMES: MappingProxyType[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        # mixtures of experts: the router, and Qwen2-MoE's shared expert and its gate
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        # gpt-oss: its FFN norm, and the attention sinks (a bare parameter: `.weight` in the file only)
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        # deepseek2 (DeepSeek-V2/V3, Kimi-K2): MLA's projections and norms, V3's router correction bias.
        # attn_k_b / attn_v_b (a split kv_b_proj) get stand-in names, joined by loader/gguf_deepseek.py.
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.attn_k_b",
        "attn_v_b": "self_attn.attn_v_b",
        "exp_probs_b": "mlp.gate",
    }
)
# The experts' 3-D tensors (one matrix per expert), and the per-expert tensors of older Mixtral files
# (`blk.N.ffn_gate.E.weight`).
_EXPERT_PARTS: MappingProxyType[str, str] = MappingProxyType(
    {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_OLD_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name; ValueError for one this loader does not know (or
    for a 3-D expert tensor, which has one name per expert: hf_matrix_names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    old_expert = _OLD_EXPERT_TENSOR.fullmatch(gguf_name)
    if old_expert is not None:
        layer, part, expert = old_expert.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, part, kind = match.groups()
    if part == "attn_sinks":
        return f"model.layers.{layer}.self_attn.sinks"
    if part == "exp_probs_b":  # a bare buffer of the router: `.bias` in the file only
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def hf_matrix_names(tensor) -> list[str]:
    """The Hugging Face names of a tensor's matrices: one per expert of a 3-D `ffn_*_exps` tensor (the
    checkpoint's per-expert names; of a 2-D one for their biases, gpt-oss), else its one name."""
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    if match is None or match.group(2) not in _EXPERT_PARTS:
        return [hf_tensor_name(tensor.name)]
    layer, part, kind = match.groups()
    if len(tensor.shape) != (3 if kind == "weight" else 2):
        raise ValueError(f"unexpected expert tensor {tensor.name!r} of shape {tensor.shape} in GGUF file")
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_PARTS[part]}.{kind}" for e in range(tensor.shape[-1])
    ]
