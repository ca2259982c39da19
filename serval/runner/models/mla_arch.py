"""The shape of DeepSeek-V2/V3's multi-head latent attention (MLA) and of their experts, read from config.json.

MLA projects each token to a compressed latent c_kv (kv_lora_rank values) and one roped key part shared by
every head (qk_rope_head_dim); kv_b_proj expands the latent into each head's unroped key (qk_nope_head_dim)
and value (v_head_dim). The query comes straight from q_proj or through a low-rank pair (q_lora_rank). Kimi-K2
is DeepseekV3ForCausalLM with other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose attention is MLA (models/deepseek.py).
MLA_DECODERS = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


@dataclass(frozen=True)
class MlaArch:
    kv_lora_rank: int  # the latent's width: what the cache keeps a token, with the roped key part
    qk_nope_head_dim: int  # each head's key and query dims without RoPE (absorbed into the latent)
    qk_rope_head_dim: int  # the roped dims, one key part for all heads
    v_head_dim: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    # The checkpoint's roped dims come in pairs (x0, x1), (x2, x3) ... (GPT-J style), not in halves: V2
    # always, V3 unless its config says rope_interleave false.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cache row: [c_kv, roped key]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, architecture: str, cfg: dict) -> MlaArch:
        q_lora_rank = cfg.get("q_lora_rank")
        return cls(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            rope_interleave=architecture == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
        )


def deepseek_moe_keys(cfg: dict) -> dict:
    """DeepSeek's expert keys as MoeArch's arguments (transformers' DeepseekV2/V3 configs), or {} for a
    config without routed experts (every MLP dense)."""
    num_layers = int(cfg["num_hidden_layers"])
    first_sparse = int(cfg.get("first_k_dense_replace") or 0)
    if not cfg.get("n_routed_experts") or first_sparse >= num_layers:
        return {}
    top_k, num_experts = int(cfg["num_experts_per_tok"]), int(cfg["n_routed_experts"])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    # transformers' DeepseekV2TopkRouter never renormalizes (norm_topk_prob is V3's); both scale the weights
    # by routed_scaling_factor.
    is_v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    scaling = float(cfg.get("routed_scaling_factor") or 1.0)
    if is_v3 or cfg.get("topk_method", "greedy") != "greedy" or scaling != 1.0:
        # NOTE: V3's sigmoid router (correction bias, group-limited top-k) and the routed scaling come with
        # runner/moe.py's router features; until then such a checkpoint is refused, not run wrongly.
        raise ValueError(
            "DeepSeek routing other than V2's greedy softmax top-k with routed_scaling_factor 1 is not supported yet"
        )
    width = int(cfg["moe_intermediate_size"])
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "expert_intermediate_size": width,
        "renormalize": is_v3 and bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": frozenset(range(first_sparse)),
        "shared_expert_intermediate_size": width * int(cfg.get("n_shared_experts") or 0),
        "shared_expert_gated": False,  # added to the routed sum as it is
    }
