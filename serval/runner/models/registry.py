"""Registry of model architectures by their Hugging Face name, imported lazily on first use.

Protocol of a model class: `__init__(arch: ArchConfig, max_positions: int)`, `load_weights(iterable of
(hf_name, tensor))`, and `forward(input_ids, positions, kv_caches, meta, logit_rows) -> logits`. A multimodal
one also has `check_media(prompt_token_ids, items)`, `mrope_positions(num_tokens, items)`, `encode(items)`,
`max_position` and a `media=` argument of forward (runner/media.py says when the runner uses them).
"""

from __future__ import annotations

import importlib

# architecture name -> (module, class). Mistral, Qwen, gpt-oss, MiniMax-M2 and the MoE forms differ from Llama
# only in ArchConfig.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    # The same decoders saved without a head (embedding checkpoints: runner/pooling.py).
    "LlamaModel": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "MistralModel": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2Model": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3Model": ("serval.runner.models.llama", "LlamaForCausalLM"),
    # Their mixtures of experts: the same decoder with sparse MLPs (ArchConfig.moe, runner/moe.py).
    "MixtralForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "GptOssForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    "MiniMaxM2ForCausalLM": ("serval.runner.models.llama", "LlamaForCausalLM"),
    # GLM's: the same decoder with partial RoPE, and GLM-4's extra norms (models/glm.py).
    "GlmForCausalLM": ("serval.runner.models.glm", "GlmForCausalLM"),
    "ChatGLMModel": ("serval.runner.models.glm", "ChatGlmForCausalLM"),  # THUDM's ChatGLM2/3 (remote code)
    "Glm4ForCausalLM": ("serval.runner.models.glm", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("serval.runner.models.glm", "Glm4MoeForCausalLM"),
    # Multi-head latent attention (runner/mla.py), dense and sparse layers.
    "DeepseekV2ForCausalLM": ("serval.runner.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("serval.runner.models.deepseek", "DeepseekForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("serval.runner.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": (
        "serval.runner.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
    ),
    "Qwen2AudioForConditionalGeneration": (
        "serval.runner.models.qwen2_audio",
        "Qwen2AudioForConditionalGeneration",
    ),
}


class UnknownArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type:
    if architecture not in _ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module_name), class_name)
