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
        # gpt-oss and GLM-4.5: their FFN norm; gpt-oss's attention sinks (a bare parameter: `.weight` in the
        # file only)
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        # deepseek2 (DeepSeek-V2/V3, Kimi-K2): MLA's projections and norms
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
    }
)
_SHARED_EXPERTS = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Where an architecture spells a part otherwise (llama.cpp's tensor_mapping.py): GLM-4's post-block norms and
# its fused gate_up in ffn_up; DeepSeek-style ungated shared experts (GLM-4.5, DeepSeek-V2/V3).
_ARCH_LAYER_NAMES: MappingProxyType[str, dict[str, str]] = MappingProxyType(
    {
        "glm4": {
            "post_attention_norm": "post_self_attn_layernorm",
            "post_ffw_norm": "post_mlp_layernorm",
            "ffn_up": "mlp.gate_up_proj",
        },
        # ChatGLM's fused q/k/v goes to our own fused matrix (ChatGlmForCausalLM takes it whole)
        "chatglm": {"ffn_up": "mlp.gate_up_proj", "attn_qkv": "self_attn.qkv_proj"},
        "glm4moe": _SHARED_EXPERTS,
        "deepseek2": _SHARED_EXPERTS,
    }
)
# The experts' 3-D tensors (one matrix per expert), and the per-expert tensors of older Mixtral files
# (`blk.N.ffn_gate.E.weight`).
_EXPERT_PARTS: MappingProxyType[str, str] = MappingProxyType(
    {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
)
# deepseek2's kv_b_proj as newer files split it: attn_k_b (heads, kv_lora_rank, qk_nope), each head's W_UK
# transposed, and attn_v_b (heads, v_head, kv_lora_rank): one matrix a head, which models/deepseek.py joins.
SPLIT_KV_B_PARTS = ("attn_k_b", "attn_v_b")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# GLM-4.5's multi-token-prediction layer (after the last block): named for the model to pass over
_NEXTN_TENSOR = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.(weight|bias)")
_OLD_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_tensor_name(gguf_name: str, arch: str = "") -> str:
    """The Hugging Face name of a llama.cpp tensor name in a file of general.architecture `arch`; ValueError
    for one this loader does not know (or for a 3-D expert tensor, which has one name per expert:
    hf_matrix_names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    nextn = _NEXTN_TENSOR.fullmatch(gguf_name)
    if nextn is not None:
        return "model.layers.{}.{}.{}".format(*nextn.groups())
    old_expert = _OLD_EXPERT_TENSOR.fullmatch(gguf_name)
    if old_expert is not None:
        layer, part, expert = old_expert.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if match is None or match.group(2) not in names | {"exp_probs_b": ""}:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, part, kind = match.groups()
    if part == "attn_sinks":
        return f"model.layers.{layer}.self_attn.sinks"
    if part == "exp_probs_b":  # the router's selection bias (e_score_correction_bias), a bare parameter
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{layer}.{names[part]}.{kind}"


def hf_matrix_names(tensor, arch: str = "") -> list[str]:
    """The Hugging Face names of a tensor's matrices: one per expert of a 3-D `ffn_*_exps` tensor (the
    checkpoint's per-expert names; of a 2-D one for their biases, gpt-oss), one per head of deepseek2's
    attn_k_b / attn_v_b, else its one name."""
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    if match is not None and match.group(2) in SPLIT_KV_B_PARTS and len(tensor.shape) == 3:
        layer, part, _ = match.groups()
        return [f"model.layers.{layer}.self_attn.{part}.{h}.weight" for h in range(tensor.shape[-1])]
    if match is None or match.group(2) not in _EXPERT_PARTS:
        return [hf_tensor_name(tensor.name, arch)]
    layer, part, kind = match.groups()
    if len(tensor.shape) != (3 if kind == "weight" else 2):
        raise ValueError(f"unexpected expert tensor {tensor.name!r} of shape {tensor.shape} in GGUF file")
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_PARTS[part]}.{kind}" for e in range(tensor.shape[-1])
    ]
