"""MoeArch: the experts and router of a mixture-of-experts decoder, read from a Hugging Face config.json dict.

Owns which families are mixtures of experts and how each spells its experts (_MOE_FAMILIES): the expert width
key, the router's scoring function (softmax, or DeepSeek-V3 / GLM-4.5 / MiniMax-M2's sigmoid with a
per-expert selection bias), group-limited top-k, shared experts (Qwen2-MoE's gated one, DeepSeek's ungated
ones) and which layers stay dense. runner/moe.py computes what these facts describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoeFamily:
    """How one family's config.json spells its experts (transformers' config classes and their defaults)."""

    expert_width_key: str  # the width of one routed expert's MLP
    renormalize_default: bool | None  # norm_topk_prob's default; None: the family always renormalizes
    has_shared_expert: bool  # Qwen2-MoE: a dense expert beside the routed ones, behind a sigmoid gate
    has_biases: bool = False  # gpt-oss: the router and every expert projection have biases
    activation: str = "silu"  # MoeArch.activation
    # gpt-oss's checkpoints: gate_up_proj (E, hidden, 2I) with gate and up in alternate columns
    interleaved_gate_up: bool = False
    scoring: str = "softmax"  # MoeArch.scoring
    has_score_correction: bool = False  # an e_score_correction_bias (DeepSeek-V3, GLM-4.5, MiniMax-M2)
    group_scoring: str = "top2_sum"  # MoeArch.group_scoring, where the config asks for groups (n_group > 1)
    # DeepSeek's ungated shared experts (n_shared_experts x moe_intermediate_size, one MLP), and the defaults
    # of the DeepSeek-style keys a config may leave out (first_k_dense_replace, n_shared_experts, ...)
    has_shared_experts: bool = False
    defaults: dict = field(default_factory=dict)


_DEEPSEEK_V3_DEFAULTS = {
    "first_k_dense_replace": 3, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4
}  # fmt: skip
_MOE_FAMILIES = {
    "Qwen3MoeForCausalLM": MoeFamily("moe_intermediate_size", False, False),
    "Qwen2MoeForCausalLM": MoeFamily("moe_intermediate_size", False, True),
    "MixtralForCausalLM": MoeFamily("intermediate_size", None, False),
    # top-k of the logits, then a softmax over those k: the same as renormalizing
    "GptOssForCausalLM": MoeFamily(
        "intermediate_size", None, False, has_biases=True, activation="clamped_swiglu", interleaved_gate_up=True
    ),
    # noaux_tc: sigmoid scores, biased for the choice, groups ranked by their top-2 biased scores
    "DeepseekV3ForCausalLM": MoeFamily(
        "moe_intermediate_size", True, False, scoring="sigmoid", has_score_correction=True,
        has_shared_experts=True, defaults=_DEEPSEEK_V3_DEFAULTS,
    ),
    "Glm4MoeForCausalLM": MoeFamily(
        "moe_intermediate_size", True, False, scoring="sigmoid", has_score_correction=True,
        has_shared_experts=True, defaults={"first_k_dense_replace": 1, "n_shared_experts": 1},
    ),
    # group_limited_greedy (topk_method): softmax scores, groups ranked by their best score
    "DeepseekV2ForCausalLM": MoeFamily(
        "moe_intermediate_size", False, False, group_scoring="max", has_shared_experts=True,
        defaults={"n_shared_experts": 2},
    ),
    "MiniMaxM2ForCausalLM": MoeFamily("intermediate_size", None, False, scoring="sigmoid", has_score_correction=True),
}  # fmt: skip
MOE_ARCHITECTURES = frozenset(_MOE_FAMILIES)


@dataclass(frozen=True)
class MoeArch:
    """The routed experts of a mixture-of-experts decoder: each token's router logits (a linear map of its
    hidden state) become scores (softmax, or sigmoid); the top_k experts by score (plus a per-expert
    selection bias where the family has one, and within the best topk_groups of num_groups groups) are
    chosen; their SwiGLU MLPs' outputs are summed with the unbiased scores as weights, renormalized over the
    chosen k when `renormalize`, times routed_scaling_factor (softmax -> top-k -> renormalize equals a
    softmax over the top-k logits)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    dense_layers: frozenset[int]  # layers whose MLP is dense (intermediate_size wide), not sparse
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    has_biases: bool = False  # the router and the experts' gate, up and down projections add biases
    # "silu": silu(gate) * up; "clamped_swiglu" (gpt-oss): g = min(gate, limit), u = clamp(up, -limit, limit),
    # g * sigmoid(alpha g) * (u + 1)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved_gate_up: bool = False  # how the HF checkpoint lays out its fused experts (MoeFamily)
    scoring: str = "softmax"  # the router's scores: "softmax" over the experts, or an independent "sigmoid"
    # A learned per-expert bias added to the scores only to choose the experts (e_score_correction_bias)
    has_score_correction: bool = False
    # Group-limited top-k: the experts are num_groups equal groups, and only the best topk_groups groups'
    # experts may be chosen; a group's rank is the sum of its two best (biased) scores ("top2_sum",
    # DeepSeek-V3's noaux_tc) or its best score ("max", DeepSeek-V2's group_limited_greedy).
    num_groups: int = 1
    topk_groups: int = 1
    group_scoring: str = "top2_sum"
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (after renormalizing)
    # DeepSeek-style shared experts: one ungated MLP this wide (n_shared_experts x moe_intermediate_size)
    # whose output joins the routed experts'; 0: none
    shared_experts_intermediate_size: int = 0

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def has_plain_routing(self) -> bool:
        """Softmax, top-k of all experts, no bias or scale: the routing kernels/decode_stack.cpp computes."""
        return (
            self.scoring == "softmax"
            and not self.has_score_correction
            and self.num_groups == 1
            and self.routed_scaling_factor == 1.0
        )

    @classmethod
    def from_hf_config(cls, architecture: str, cfg: dict) -> MoeArch:
        family = _MOE_FAMILIES[architecture]

        def value(key: str, default=None):
            found = cfg.get(key)
            return family.defaults.get(key, default) if found is None else found

        renormalize = family.renormalize_default is None or bool(
            value("norm_topk_prob", family.renormalize_default)
        )
        # Released Qwen-MoE configs say num_experts; transformers 5 writes num_local_experts for every family
        # (DeepSeek's and GLM's released configs: n_routed_experts).
        top_k = int(cfg["num_experts_per_tok"])
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"])
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
        num_groups, topk_groups = _groups(cfg, value, num_experts, top_k)
        expert_width = int(cfg[family.expert_width_key])
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_width,
            renormalize=renormalize,
            dense_layers=_dense_layers(cfg, int(value("first_k_dense_replace", 0))),
            shared_expert_intermediate_size=(
                int(cfg.get("shared_expert_intermediate_size") or 0) if family.has_shared_expert else 0
            ),
            has_biases=family.has_biases,
            activation=family.activation,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            interleaved_gate_up=family.interleaved_gate_up,
            scoring=family.scoring,
            has_score_correction=family.has_score_correction,
            num_groups=num_groups,
            topk_groups=topk_groups,
            group_scoring=family.group_scoring,
            routed_scaling_factor=float(value("routed_scaling_factor", 1.0)),
            shared_experts_intermediate_size=(
                int(value("n_shared_experts", 0)) * expert_width if family.has_shared_experts else 0
            ),
        )


def _dense_layers(cfg: dict, first_k_dense: int) -> frozenset[int]:
    # Qwen-MoE: layer i is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0
    # (transformers' Qwen2MoeDecoderLayer); DeepSeek / GLM-4.5: the first first_k_dense_replace layers are dense.
    step = int(cfg.get("decoder_sparse_step") or 1)
    listed = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return frozenset(
        i
        for i in range(int(cfg["num_hidden_layers"]))
        if i < first_k_dense or i in listed or (i + 1) % step != 0
    )


def _groups(cfg: dict, value, num_experts: int, top_k: int) -> tuple[int, int]:
    """(num_groups, topk_groups) of group-limited routing; (1, 1) without (DeepSeek-V2's greedy topk_method)."""
    if cfg.get("topk_method") == "greedy":
        return 1, 1
    num_groups, topk_groups = int(value("n_group", 1) or 1), int(value("topk_group", 1) or 1)
    if num_groups == 1:
        return 1, 1
    if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"n_group {num_groups}, topk_group {topk_groups} do not divide {num_experts} experts"
        )
    if topk_groups * (num_experts // num_groups) < top_k:
        raise ValueError(f"topk_group {topk_groups} of {num_groups} groups hold fewer than {top_k} experts")
    return num_groups, topk_groups
