"""The model shapes bench/make_model.py writes: llama.cpp's tensors of each architecture (a layer table of
names, dimension names and roles), how each role is filled, and the real models' dimensions (Llama 3.2
1B/3B, Llama 2 7B, Qwen3-30B-A3B and its 12-layer cut, gpt-oss-20b, DeepSeek-V2-Lite, and a tiny self-check
shape).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gguf
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES

# Matrices are N(0, WEIGHT_STD): with RMS-normed inputs a projection's outputs have std
# WEIGHT_STD * sqrt(fan_in) (about 1.3 at hidden 4096), so activations stay finite through every layer.
WEIGHT_STD = 0.02
NORM_NOISE_STD = 0.02  # norm weights are ones plus this much noise
BIAS_STD = 0.02
SINK_STD = 1.0  # gpt-oss's attention sinks are per-head logits, of the order of the attention scores


@dataclass(frozen=True)
class Role:
    """How one kind of tensor is typed and filled: mean + std * N(0, 1), in F32 unless `weight_field`
    names the WeightType field that types it. std None: 1 / sqrt(fan_in)."""

    weight_field: str | None
    mean: float
    std: float | None


NORM = Role(None, 1.0, NORM_NOISE_STD)
MATRIX = Role("matrix", 0.0, WEIGHT_STD)
EXPERTS = Role("experts", 0.0, WEIGHT_STD)
EMBEDDING = Role("embedding", 0.0, WEIGHT_STD)
OUTPUT = Role("output", 0.0, WEIGHT_STD)
# Router rows of std 1/sqrt(hidden) give unit-RMS inputs logits of std about 1: a softmax over the experts
# that is neither flat (every expert alike) nor one-hot, so the top-k choice moves from token to token.
# It stays F32, as llama.cpp's converter keeps ffn_gate_inp.
ROUTER = Role(None, 0.0, None)
BIAS = Role(None, 0.0, BIAS_STD)
SINKS = Role(None, 0.0, SINK_STD)

# One layer's tensors: (name under blk.N., numpy shape in dimension names, role). Numpy order is ggml's ne
# reversed: an expert stack is (experts, out_features, in_features). Dimension names are keys of
# ModelShape.dimensions().
LayerTable = tuple[tuple[str, tuple[str, ...], Role], ...]

# Unbiased attention (Llama, Qwen3-MoE), and a router over SiLU-gated experts with no biases (Qwen3-MoE).
_ATTENTION: LayerTable = (
    ("attn_norm.weight", ("hidden",), NORM),
    ("attn_q.weight", ("q", "hidden"), MATRIX),
    ("attn_k.weight", ("kv", "hidden"), MATRIX),
    ("attn_v.weight", ("kv", "hidden"), MATRIX),
    ("attn_output.weight", ("hidden", "q"), MATRIX),
)
_ROUTED_EXPERTS: LayerTable = (
    ("ffn_gate_inp.weight", ("experts", "hidden"), ROUTER),
    ("ffn_gate_exps.weight", ("experts", "expert_ffn", "hidden"), EXPERTS),
    ("ffn_up_exps.weight", ("experts", "expert_ffn", "hidden"), EXPERTS),
    ("ffn_down_exps.weight", ("experts", "hidden", "expert_ffn"), EXPERTS),
)

# NOTE: llama.cpp stores a Llama attn_q/attn_k with rows permuted per head; random rows need no permuting
LLAMA_LAYER: LayerTable = _ATTENTION + (
    ("ffn_norm.weight", ("hidden",), NORM),
    ("ffn_gate.weight", ("ffn", "hidden"), MATRIX),
    ("ffn_up.weight", ("ffn", "hidden"), MATRIX),
    ("ffn_down.weight", ("hidden", "ffn"), MATRIX),
)

# llama.cpp's src/models/qwen3moe.cpp: per-head RMSNorm of q and k, a softmax router over every expert
# (top-k weights renormalized), SiLU-gated experts, no dense or shared FFN.
QWEN3MOE_LAYER: LayerTable = (
    _ATTENTION
    + (
        ("attn_q_norm.weight", ("head_dim",), NORM),
        ("attn_k_norm.weight", ("head_dim",), NORM),
        ("ffn_norm.weight", ("hidden",), NORM),
    )
    + _ROUTED_EXPERTS
)

# llama.cpp's src/models/openai-moe.cpp: biased q/k/v/o, a learned sink logit per head, the FFN's norm
# named post_attention_norm, a biased router whose top-k logits are softmaxed, biased experts with
# clamped SwiGLU (alpha 1.702, limit 7, fixed in llama.cpp), sliding-window attention on every other layer.
GPT_OSS_LAYER: LayerTable = (
    ("attn_norm.weight", ("hidden",), NORM),
    ("attn_q.weight", ("q", "hidden"), MATRIX),
    ("attn_q.bias", ("q",), BIAS),
    ("attn_k.weight", ("kv", "hidden"), MATRIX),
    ("attn_k.bias", ("kv",), BIAS),
    ("attn_v.weight", ("kv", "hidden"), MATRIX),
    ("attn_v.bias", ("kv",), BIAS),
    ("attn_output.weight", ("hidden", "q"), MATRIX),
    ("attn_output.bias", ("hidden",), BIAS),
    ("attn_sinks.weight", ("heads",), SINKS),
    ("post_attention_norm.weight", ("hidden",), NORM),
    ("ffn_gate_inp.weight", ("experts", "hidden"), ROUTER),
    ("ffn_gate_inp.bias", ("experts",), BIAS),
    ("ffn_gate_exps.weight", ("experts", "expert_ffn", "hidden"), EXPERTS),
    ("ffn_gate_exps.bias", ("experts", "expert_ffn"), BIAS),
    ("ffn_up_exps.weight", ("experts", "expert_ffn", "hidden"), EXPERTS),
    ("ffn_up_exps.bias", ("experts", "expert_ffn"), BIAS),
    ("ffn_down_exps.weight", ("experts", "hidden", "expert_ffn"), EXPERTS),
    ("ffn_down_exps.bias", ("experts", "hidden"), BIAS),
)


# llama.cpp's src/models/deepseek2.cpp, as DeepSeek-V2-Lite has it (no q LoRA; kv_b_proj whole, as converters
# wrote it before splitting it into attn_k_b / attn_v_b): multi-head latent attention, then a softmax router
# over the routed experts beside ungated shared ones; the first leading_dense_block_count layers dense.
_MLA_ATTENTION: LayerTable = (
    ("attn_norm.weight", ("hidden",), NORM),
    ("attn_q.weight", ("mla_q", "hidden"), MATRIX),
    ("attn_kv_a_mqa.weight", ("mla_kv_a", "hidden"), MATRIX),
    ("attn_kv_a_norm.weight", ("kv_lora",), NORM),
    ("attn_kv_b.weight", ("mla_kv_b", "kv_lora"), MATRIX),
    ("attn_output.weight", ("hidden", "mla_o"), MATRIX),
    ("ffn_norm.weight", ("hidden",), NORM),
)
DEEPSEEK2_LAYER: LayerTable = (
    _MLA_ATTENTION
    + _ROUTED_EXPERTS
    + (
        ("ffn_gate_shexp.weight", ("shared_ffn", "hidden"), MATRIX),
        ("ffn_up_shexp.weight", ("shared_ffn", "hidden"), MATRIX),
        ("ffn_down_shexp.weight", ("hidden", "shared_ffn"), MATRIX),
    )
)
DEEPSEEK2_DENSE_LAYER: LayerTable = _MLA_ATTENTION + LLAMA_LAYER[-3:]  # ffn_gate, ffn_up, ffn_down


@dataclass(frozen=True)
class Architecture:
    arch: MODEL_ARCH  # gguf-py's id: general.architecture and the tensor names llama.cpp expects
    layer: LayerTable
    dense_layer: LayerTable = ()  # the leading dense layers' table (DeepSeek's); () : every layer is `layer`

    def layer_table(self, index: int, num_dense: int) -> LayerTable:
        return self.dense_layer if index < num_dense and self.dense_layer else self.layer

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]

    def check_names(self) -> None:
        """Every tensor name of the layer table is one gguf-py lists for this architecture."""
        known = {gguf.TENSOR_NAMES[tensor] for tensor in gguf.MODEL_TENSORS[self.arch]}
        for part, _, _ in self.layer + self.dense_layer:
            stem = "blk.{bid}." + part.rsplit(".", 1)[0]
            if stem not in known:
                raise ValueError(f"{stem} is not a {self.name} tensor in gguf-py's MODEL_TENSORS")


LLAMA = Architecture(MODEL_ARCH.LLAMA, LLAMA_LAYER)
QWEN3MOE = Architecture(MODEL_ARCH.QWEN3MOE, QWEN3MOE_LAYER)
GPT_OSS = Architecture(MODEL_ARCH.GPT_OSS, GPT_OSS_LAYER)
DEEPSEEK2 = Architecture(MODEL_ARCH.DEEPSEEK2, DEEPSEEK2_LAYER, DEEPSEEK2_DENSE_LAYER)


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_context_length: int
    beta_fast: float
    beta_slow: float
    log_multiplier: float = 0.0  # DeepSeek's 0.1 mscale_all_dim (rope.scaling.yarn_log_multiplier); 0: none


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    tie_word_embeddings: bool  # True: no output.weight, the head reads token_embd.weight
    context_length: int  # what <arch>.context_length says, not always the model's trained maximum
    arch: Architecture = LLAMA
    rms_norm_eps: float = 1e-5
    num_experts: int = 0  # 0: a dense model
    num_experts_used: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int = 0  # 0: no sliding-window layers
    yarn: YarnScaling | None = None
    mla: MlaShape | None = None  # DeepSeek's attention (head_dim is then the roped part's)
    num_dense_layers: int = 0  # leading dense layers of a mixture of experts (leading_dense_block_count)
    num_shared_experts: int = 0  # DeepSeek's ungated shared experts, each expert_intermediate_size wide
    vocab_size: int = 0  # the token count to write, padding the default model's vocabulary; 0: as it is

    def dimensions(self) -> dict[str, int]:
        """The sizes the layer tables name."""
        mla = self.mla or MlaShape(0, 0, 0, 0)
        return {
            "kv_lora": mla.kv_lora_rank,
            "mla_q": self.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim),
            "mla_kv_a": mla.kv_lora_rank + mla.qk_rope_head_dim,
            "mla_kv_b": self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            "mla_o": self.num_heads * mla.v_head_dim,
            "shared_ffn": self.num_shared_experts * self.expert_intermediate_size,
            "hidden": self.hidden_size,
            "heads": self.num_heads,
            "head_dim": self.head_dim,
            "q": self.num_heads * self.head_dim,
            "kv": self.num_kv_heads * self.head_dim,
            "ffn": self.intermediate_size,
            "experts": self.num_experts,
            "expert_ffn": self.expert_intermediate_size,
        }


# From the models' config.json files.
# NOTE: Llama 3.2 is trained to 131072 positions with llama3 rope scaling; we write 8192 (its pre-scaling
# length) and no rope_freqs.weight: position scaling changes the numbers, not the cost of a step, and a
# 131072 context would make llama-server reserve a KV cache for it by default.
# NOTE: the MoE shapes keep their configs' context lengths (Qwen3-30B-A3B 40960, gpt-oss 131072 = its YaRN
# 4096 x 32); pass llama-server a -c. intermediate_size is Qwen3's unused dense width (6144) and gpt-oss's
# expert width, as their converters write <arch>.feed_forward_length.
_QWEN3_30B_A3B = ModelShape(
    "qwen3-30b-a3b", hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
    head_dim=128, rope_theta=1e6, tie_word_embeddings=False, context_length=40960, arch=QWEN3MOE,
    rms_norm_eps=1e-6, num_experts=128, num_experts_used=8, expert_intermediate_size=768,
)  # fmt: skip
DEEPSEEK_V2_LITE = ModelShape(
    "deepseek-v2-lite", hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16, num_kv_heads=16,
    head_dim=64, rope_theta=10000.0, tie_word_embeddings=False, context_length=163840, arch=DEEPSEEK2,
    rms_norm_eps=1e-6, num_experts=64, num_experts_used=6, expert_intermediate_size=1408,
    yarn=YarnScaling(40.0, 4096, 32.0, 1.0, log_multiplier=0.0707), mla=MlaShape(512, 128, 64, 128),
    num_dense_layers=1, num_shared_experts=2, vocab_size=102400,
)  # fmt: skip
SHAPES = {
    shape.name: shape
    for shape in (
        ModelShape("tiny", 256, 768, 4, 4, 2, 64, 10000.0, True, 2048),
        ModelShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, 500000.0, True, 8192),
        ModelShape("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128, 500000.0, True, 8192),
        ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 128, 10000.0, False, 4096),
        # Llama 3.1 8B's layers (GQA 32/8, head 128) over SmolLM2's vocabulary, as every shape here
        ModelShape("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, 500000.0, False, 8192),
        _QWEN3_30B_A3B,
        dataclasses.replace(_QWEN3_30B_A3B, name="qwen3-30b-a3b-12l", num_layers=12),
        ModelShape(
            "gpt-oss-20b", hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64,
            num_kv_heads=8, head_dim=64, rope_theta=150000.0, tie_word_embeddings=False, context_length=131072,
            arch=GPT_OSS, rms_norm_eps=1e-5, num_experts=32, num_experts_used=4, expert_intermediate_size=2880,
            sliding_window=128, yarn=YarnScaling(32.0, 4096, 32.0, 1.0),
        ),
        # 15.7B parameters, 2.4B active: 26 of its 27 layers have 64 experts of 1408 (top-6) beside 2 shared
        DEEPSEEK_V2_LITE,
    )
}  # fmt: skip
