"""ArchConfig: the shape of a decoder-only transformer, read from a Hugging Face config.json dict.

GGUF files are first turned into the same dict (loader/gguf.py), so every model class sees one vocabulary.
A multimodal checkpoint (Qwen2-VL, Qwen2.5-VL) adds the shape of its vision tower (VisionArch) and M-RoPE's
sections, or (Qwen2-Audio) the shape of its audio encoder (AudioArch); its language model is read from
`text_config` when the config nests it (transformers 5 writes it so), from the top level otherwise (the
released Qwen2-VL checkpoints). A mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral) adds MoeArch: its
experts, router and which layers are sparse (models/moe_arch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from serval.runner.models.mla_arch import MLA_DECODERS, MlaArch
from serval.runner.models.moe_arch import MOE_ARCHITECTURES, MoeArch


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear", "llama3" or "yarn" (transformers' rope_parameters; "default" is None)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # YaRN: the band of frequencies between beta_fast and beta_slow rotations over the original context is
    # blended from interpolated to kept; cos and sin are scaled by attention_factor (None: 0.1 ln(factor) + 1,
    # or the mscale ratio when both mscale keys are given); truncate rounds the band's edges to whole dims.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


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
    qk_norm: bool  # RMSNorm on q and k before RoPE: per head (Qwen3, GLM-4.5's use_qk_norm)
    rope_scaling: RopeScaling | None = None
    o_proj_bias: bool = False  # the output projection carries a bias too (gpt-oss, Llama's attention_bias)
    # Sliding-window attention: the layers whose queries see only the last sliding_window positions up to
    # their own (gpt-oss: the even layers; transformers' layer_types, or every layer of a Mistral/Mixtral
    # config with a sliding_window).
    sliding_window: int = 0
    sliding_layers: frozenset[int] = frozenset()
    attention_sinks: bool = False  # a learned logit per head joins every softmax (gpt-oss)
    # Partial RoPE (GLM-4, GLM-4.5, MiniMax-M2): only each head's first rotary_dim dims turn; 0: all of them.
    rotary_dim: int = 0
    rope_interleaved: bool = False  # GLM-4: dims (2i, 2i+1) turn together, not (i, i + rotary_dim / 2)
    qk_norm_over_heads: bool = False  # MiniMax-M2: q's (k's) norm spans all its heads' dims at once
    # M-RoPE (Qwen2-VL): how many rotary frequencies follow each position axis (t, h, w, t, ...); empty: 1-D
    mrope_section: tuple[int, ...] = ()
    vision: VisionArch | None = None  # the vision tower of a multimodal model
    audio: AudioArch | None = None  # the audio encoder of a multimodal model
    moe: MoeArch | None = None  # the experts of a mixture-of-experts model; None: every MLP is dense
    mla: MlaArch | None = None  # DeepSeek's multi-head latent attention (head_dim is then its roped part's)
    # False for a bare decoder (Qwen3Model, what sentence-transformers saves) and any embedding model: no
    # lm_head is loaded (runner/pooling.py reads its final hidden states instead of logits).
    has_lm_head: bool = True

    @property
    def rope_dim(self) -> int:
        """The dims of each q/k head that RoPE turns (the first ones)."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ArchConfig:
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture ('architectures' is empty)")
        architecture = architectures[0]
        if isinstance(cfg.get("text_config"), dict):  # the top level wins (tie_word_embeddings, model_type)
            text = cfg["text_config"]
            if architecture == "Qwen2AudioForConditionalGeneration":
                # NOTE: the released Qwen2-Audio config.json lists only what differs from Qwen2Config's
                # defaults (no hidden_size, no layer count): transformers fills in the rest, so do we.
                text = {**_QWEN2_CONFIG_DEFAULTS, **text}
            cfg = {**text, **cfg}
        if cfg.get("model_type") == "chatglm":
            cfg = _chatglm_as_hf(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden_size // num_heads
        if architecture in MLA_DECODERS:  # the rotary tables' width (DeepSeek's configs may lack head_dim)
            head_dim = cfg["qk_rope_head_dim"]
        attention_bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", architecture in _QWEN2_DECODERS)))
        sliding_window, sliding_layers = _sliding_window(architecture, cfg)
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
            # Qwen2 always has q/k/v biases (and none on o); Llama-family configs say so with attention_bias.
            attention_bias=attention_bias,
            qk_norm=architecture in _QK_NORM_DECODERS
            or bool(cfg.get("use_qk_norm"))
            and architecture in _USE_QK_NORM_DECODERS,
            rope_scaling=_rope_scaling(cfg),
            o_proj_bias=attention_bias and architecture not in _QWEN2_DECODERS | _GLM_DECODERS,
            rotary_dim=_rotary_dim(architecture, cfg, int(head_dim)),
            rope_interleaved=architecture in _INTERLEAVED_ROPE_DECODERS,
            qk_norm_over_heads=architecture in _QK_NORM_OVER_HEADS_DECODERS,
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            attention_sinks=architecture in _SINK_DECODERS,
            mrope_section=_mrope_section(cfg),
            vision=VisionArch.from_hf_config(cfg) if isinstance(cfg.get("vision_config"), dict) else None,
            audio=AudioArch.from_hf_config(cfg) if isinstance(cfg.get("audio_config"), dict) else None,
            moe=MoeArch.from_hf_config(architecture, cfg) if architecture in MOE_ARCHITECTURES else None,
            mla=MlaArch.from_hf_config(architecture, cfg) if architecture in MLA_DECODERS else None,
            has_lm_head=architecture not in BARE_DECODERS,
        )


# Decoders saved without their head (AutoModel's classes): embedding checkpoints.
BARE_DECODERS = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# Architectures whose language model is Qwen2's decoder (q/k/v biases).
_QWEN2_DECODERS = frozenset(
    {
        "Qwen2ForCausalLM",
        "Qwen2Model",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2AudioForConditionalGeneration",
        "Qwen2MoeForCausalLM",
    }
)
# Architectures with a per-head RMSNorm on q and k; GLM-4.5's where its config says use_qk_norm; MiniMax-M2's
# spans all heads.
_QK_NORM_DECODERS = frozenset(
    {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3Model", "MiniMaxM2ForCausalLM"}
)
_USE_QK_NORM_DECODERS = frozenset({"Glm4MoeForCausalLM"})
_QK_NORM_OVER_HEADS_DECODERS = frozenset({"MiniMaxM2ForCausalLM"})
# GLM-4 and GLM-4.5: q/k/v biases (attention_bias) but none on o, and half the head rotary unless the config
# says otherwise (transformers' default partial_rotary_factor); GLM-4 turns adjacent dims together.
_GLM_DECODERS = frozenset({"GlmForCausalLM", "ChatGLMModel", "Glm4ForCausalLM", "Glm4MoeForCausalLM"})
_INTERLEAVED_ROPE_DECODERS = frozenset({"GlmForCausalLM", "ChatGLMModel", "Glm4ForCausalLM"})
# Architectures with a learned attention sink logit per head.
_SINK_DECODERS = frozenset({"GptOssForCausalLM"})
# Architectures whose sliding_window, without layer_types, applies to every layer (transformers' Mistral).
_ALL_LAYERS_SLIDE = frozenset({"MistralForCausalLM", "MixtralForCausalLM"})
# transformers' Qwen2Config defaults (the released Qwen2-Audio text_config relies on them).
_QWEN2_CONFIG_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip


@dataclass(frozen=True)
class AudioArch:
    """A Qwen2-Audio encoder: Whisper's (two conv1d over log-mel frames, the second of stride 2, learned
    positions, pre-norm transformer layers) with an average pool of 2 and a linear projection after."""

    num_mel_bins: int
    num_layers: int
    num_heads: int
    d_model: int  # the encoder's width
    ffn_dim: int
    activation: str  # "gelu"
    max_source_positions: int  # rows after conv2: a chunk is twice this many mel frames
    audio_token_id: int  # the prompt's <|AUDIO|> placeholder

    @property
    def chunk_frames(self) -> int:
        """The mel frames the encoder reads: every clip is padded (or cut) to this many."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf_config(cls, cfg: dict) -> AudioArch:
        a = cfg["audio_config"]  # transformers' Qwen2AudioEncoderConfig defaults where a key is missing
        return cls(
            num_mel_bins=int(a.get("num_mel_bins", 128)),
            num_layers=int(a.get("encoder_layers", 32)),
            num_heads=int(a.get("encoder_attention_heads", 20)),
            d_model=int(a.get("d_model", 1280)),
            ffn_dim=int(a.get("encoder_ffn_dim", 5120)),
            activation=str(a.get("activation_function", "gelu")),
            max_source_positions=int(a.get("max_source_positions", 1500)),
            audio_token_id=int(cfg.get("audio_token_index", cfg.get("audio_token_id", 151646))),
        )


@dataclass(frozen=True)
class VisionArch:
    """A Qwen2-VL / Qwen2.5-VL vision tower: a ViT over patch_size^2 x temporal_patch_size patches whose
    spatial_merge_size^2 neighbours are merged into one language-model token."""

    depth: int
    embed_dim: int  # the ViT's width
    num_heads: int
    intermediate_size: int  # its MLP's hidden width
    hidden_act: str  # "quick_gelu" (Qwen2-VL), "silu" (Qwen2.5-VL's gated MLP)
    out_hidden_size: int  # the language model's width (the merger's output)
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float
    # Qwen2.5-VL: RMSNorm and a gated (SwiGLU) MLP with biases; attention within windows of window_size
    # pixels except in the fullatt_block_indexes blocks; video time in M-RoPE scaled by tokens_per_second.
    is_qwen2_5: bool
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    tokens_per_second: float
    # The prompt's vision tokens (top-level config.json keys).
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def patch_dim(self) -> int:
        """The length of one row of pixel_values: channels x frames x pixels of a patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_config(cls, cfg: dict) -> VisionArch:
        v = cfg["vision_config"]
        is_qwen2_5 = cfg.get("model_type") == "qwen2_5_vl" or "out_hidden_size" in v
        embed_dim = int(v["hidden_size"] if is_qwen2_5 else v["embed_dim"])
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v["depth"]),
            embed_dim=embed_dim,
            num_heads=int(v["num_heads"]),
            intermediate_size=int(
                v["intermediate_size"] if is_qwen2_5 else embed_dim * v.get("mlp_ratio", 4)
            ),
            hidden_act=str(v.get("hidden_act", "silu" if is_qwen2_5 else "quick_gelu")),
            out_hidden_size=int(v["out_hidden_size"] if is_qwen2_5 else v["hidden_size"]),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            is_qwen2_5=is_qwen2_5,
            window_size=int(v.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
            tokens_per_second=float(v.get("tokens_per_second", 2)),
            image_token_id=int(cfg["image_token_id"]),
            video_token_id=int(cfg["video_token_id"]),
            vision_start_token_id=int(cfg["vision_start_token_id"]),
            vision_end_token_id=int(cfg["vision_end_token_id"]),
        )


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    # transformers 5 nests it under rope_parameters.
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _chatglm_as_hf(cfg: dict) -> dict:
    """THUDM's ChatGLMConfig (ChatGLM2/3, GLM-4-9B-chat's remote code) in transformers' keys; ValueError for
    the first ChatGLM-6B (2-D positions, GeLU) or a variant of the block serval does not compute."""
    if "padded_vocab_size" not in cfg or "ffn_hidden_size" not in cfg:
        raise ValueError(
            "ChatGLM-6B (the first version: 2-D positions, GeLU) is not supported; ChatGLM2/3 are"
        )
    expected = {
        "rmsnorm": True, "post_layer_norm": True, "add_bias_linear": False, "original_rope": True,
        "apply_residual_connection_post_layernorm": False,
    }  # fmt: skip
    differing = sorted(key for key, value in expected.items() if cfg.get(key, value) != value)
    if differing:
        raise ValueError(
            f"ChatGLM configs with {', '.join(differing)} other than ChatGLM3's are not supported"
        )
    num_heads, hidden_size = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    return {
        **cfg,
        "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg["num_layers"],
        "num_key_value_heads": cfg["multi_query_group_num"]
        if cfg.get("multi_query_attention")
        else num_heads,
        "head_dim": cfg.get("kv_channels") or hidden_size // num_heads,
        "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        # modeling_chatglm's RotaryEmbedding(kv_channels // 2): the first half of each head, base x rope_ratio
        "rope_theta": 10000.0 * float(cfg.get("rope_ratio") or 1.0),
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": cfg.get("seq_length", 2048),
        "vocab_size": cfg["padded_vocab_size"],
        "attention_bias": cfg.get("add_qkv_bias", True),
    }


def _rotary_dim(architecture: str, cfg: dict, head_dim: int) -> int:
    """The rotary dims of each head: MiniMax-M2's rotary_dim, or head_dim x partial_rotary_factor (top level
    or in rope_parameters, as transformers 5 writes it); 0 where all of head_dim turns."""
    if cfg.get("rotary_dim"):
        rotary_dim = int(cfg["rotary_dim"])
    else:
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
        if factor is None:
            factor = 0.5 if architecture in _GLM_DECODERS else 1.0
        rotary_dim = int(head_dim * float(factor))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dims {rotary_dim} must be even and within the head's {head_dim}")
    return 0 if rotary_dim == head_dim else rotary_dim


def _mrope_section(cfg: dict) -> tuple[int, ...]:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return tuple(int(n) for n in raw.get("mrope_section") or ())


def _sliding_window(architecture: str, cfg: dict) -> tuple[int, frozenset[int]]:
    window = int(cfg.get("sliding_window") or 0)
    if not window or cfg.get("use_sliding_window") is False:  # Qwen2's configs carry a window not in use
        return 0, frozenset()
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types:
        layers = frozenset(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif architecture in _ALL_LAYERS_SLIDE:
        layers = frozenset(range(num_layers))
    elif architecture in _SINK_DECODERS:  # gpt-oss's config class: the even layers when it lists none
        layers = frozenset(range(0, num_layers, 2))
    else:
        layers = frozenset()  # e.g. Qwen2's sliding_window without use_sliding_window: not in effect
    return (window, layers) if layers else (0, frozenset())


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type in ("default", "mrope"):  # M-RoPE: plain frequencies, split over 3 axes (mrope_section)
        return None
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported (supported: linear, llama3, yarn)"
        )

    def optional(key: str) -> float | None:
        return None if raw.get(key) is None else float(raw[key])

    factor = raw.get("factor")
    original = raw.get("original_max_position_embeddings")
    if factor is None and rope_type == "yarn" and original:  # transformers' fallback (DeepSeek-V3's configs)
        factor = int(cfg["max_position_embeddings"]) / int(original)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(raw.get("truncate", True)),
    )
