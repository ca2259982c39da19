"""The GLM family on the Llama decoder: GLM-4-9B-chat in transformers' form (GlmForCausalLM) and THUDM's
own (ChatGLM2/3, GLM-4-9B-chat: ChatGLMModel), GLM-4-0414 (Glm4ForCausalLM) and GLM-4.5/4.6
(Glm4MoeForCausalLM).

All turn half of each head (partial RoPE: ArchConfig.rotary_dim) and have q/k/v biases but none on the
output. GLM, ChatGLM and GLM-4 turn adjacent dims together (ArchConfig.rope_interleaved) and store the MLP's
gate and up as one matrix (gate rows first); ChatGLM stores q/k/v as one too, under its own names. GLM-4 norms
each block's output again before the residual (post_self_attn_layernorm, post_mlp_layernorm). GLM-4.5 routes
with sigmoid scores, a correction bias and shared experts (runner/moe.py) and may norm q and k per head; its
checkpoints carry a multi-token-prediction layer after the last one, which is not served.
"""

from __future__ import annotations

import re

from serval.runner.layers import RMSNorm
from serval.runner.models.arch import ArchConfig
from serval.runner.models.llama import DecoderLayer, LlamaForCausalLM

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class GlmForCausalLM(LlamaForCausalLM):
    """transformers' GLM: the Llama decoder with its MLP's gate_up_proj stored whole."""

    def num_shards(self, parameter: str) -> int:
        # NOTE: the checkpoint holds gate_up_proj whole (gate rows, then up rows): already our layout.
        if parameter.endswith("mlp.gate_up_proj.weight"):
            return 1
        return super().num_shards(parameter)


class Glm4DecoderLayer(DecoderLayer):
    """Llama's block with a norm on the attention's and the MLP's outputs before each joins the residual."""

    fits_decode_stack = False  # the stack has no post-block norms

    def __init__(self, arch: ArchConfig, index: int):
        super().__init__(arch, index)
        self.post_self_attn_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, rope, k_cache, v_cache, meta, lora=None):
        # x: the fp32 residual stream (DecoderLayer); with tensor parallelism each half is summed over the
        # ranks before its norm, which needs the whole row.
        attn = self._reduced(self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta, lora))
        x = x.add_(self.post_self_attn_layernorm(attn))
        mlp = self._reduced(self.mlp(self.post_attention_layernorm(x), lora))
        return x.add_(self.post_mlp_layernorm(mlp))


class Glm4ForCausalLM(GlmForCausalLM):
    layer_class = Glm4DecoderLayer


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        layer = _LAYER.match(hf_name)
        if layer is not None and int(layer[1]) >= self.arch.num_layers:
            return None  # the multi-token-prediction layer (num_nextn_predict_layers): not served
        return super().weight_target(hf_name)


# ChatGLM's tensor names (THUDM's modeling_chatglm.py) -> ours; q/k/v and gate/up arrive fused, as ours are.
_CHATGLM_GLOBAL = {
    "transformer.embedding.word_embeddings.weight": "embed_tokens.weight",
    "transformer.encoder.final_layernorm.weight": "norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
}
_CHATGLM_LAYER = re.compile(r"transformer\.encoder\.layers\.(\d+)\.(.+)")
_CHATGLM_PARTS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.query_key_value.weight": "self_attn.qkv_proj.weight",
    "self_attention.query_key_value.bias": "self_attn.qkv_proj.bias",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
}


class ChatGlmForCausalLM(GlmForCausalLM):
    """THUDM's ChatGLM2/3 (and GLM-4-9B-chat's remote-code form): GLM under ChatGLM's names, with q/k/v fused."""

    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        if not hf_name.startswith("transformer."):  # a GGUF file's: transformers' names, q/k/v fused
            return super().weight_target(hf_name)
        if hf_name == "transformer.rotary_pos_emb.inv_freq":
            return None  # recomputed from the config
        if hf_name in _CHATGLM_GLOBAL:
            return super().weight_target(_CHATGLM_GLOBAL[hf_name])
        match = _CHATGLM_LAYER.fullmatch(hf_name)
        if match is None or match[2] not in _CHATGLM_PARTS:
            raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
        return f"layers.{match[1]}.{_CHATGLM_PARTS[match[2]]}", None

    def num_shards(self, parameter: str) -> int:
        if parameter.endswith("self_attn.qkv_proj.weight"):
            return 1  # query_key_value: q rows, then k, then v, our layout
        return super().num_shards(parameter)
