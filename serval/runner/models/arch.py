"""ArchConfig: the shape of a decoder-only transformer, read from a Hugging Face config.json dict.

GGUF files are first turned into the same dict (loader/gguf.py), so every model class sees one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "default", "linear", "llama3", "yarn" (yarn: not supported, refused at load)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ArchConfig:
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture ('architectures' is empty)")
        architecture = architectures[0]
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden_size // num_heads
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-family configs say so with attention_bias.
            attention_bias=bool(cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(cfg),
        )


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    # transformers 5 nests it under rope_parameters.
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: linear, llama3)")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
