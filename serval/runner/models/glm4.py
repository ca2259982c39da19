"""GLM-4 (GLM-4-9B-0414, Glm4ForCausalLM) and GLM-4.5/4.6 (Glm4MoeForCausalLM): the Llama decoder with what
GLM adds.

Both turn half of each head (partial RoPE: ArchConfig.rotary_dim) and have q/k/v biases; GLM-4 turns adjacent
dims together (ArchConfig.rope_interleaved), norms each block's output again before the residual
(post_self_attn_layernorm, post_mlp_layernorm) and stores its MLP's gate and up as one gate_up_proj. GLM-4.5
routes with sigmoid scores, a correction bias and shared experts (runner/moe.py) and may norm q and k per
head; its checkpoints carry a multi-token-prediction layer after the last one, which is not served.
"""

from __future__ import annotations

import re

from serval.runner.layers import RMSNorm
from serval.runner.models.arch import ArchConfig
from serval.runner.models.llama import DecoderLayer, LlamaForCausalLM

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


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


class Glm4ForCausalLM(LlamaForCausalLM):
    layer_class = Glm4DecoderLayer

    def num_shards(self, parameter: str) -> int:
        # NOTE: GLM-4's checkpoints hold gate_up_proj whole (gate rows, then up rows), already our layout.
        if parameter.endswith("mlp.gate_up_proj.weight"):
            return 1
        return super().num_shards(parameter)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        layer = _LAYER.match(hf_name)
        if layer is not None and int(layer[1]) >= self.arch.num_layers:
            return None  # the multi-token-prediction layer (num_nextn_predict_layers): not served
        return super().weight_target(hf_name)
