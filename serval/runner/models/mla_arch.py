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
