"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a paged cache of latents, in the absorbed form.

A token's cache row is [c_kv (the normed latent, kv_lora_rank values), k_pe (the roped key part shared by every
head)]: 576 values for DeepSeek-V3 where Llama-style attention would keep 2 x 128 heads x 192. kv_b_proj's
per-head blocks W_UK (qk_nope x kv_lora_rank) and W_UV (v_head x kv_lora_rank) are never applied to the cache:

    score(t, s) = q_nope_t . (W_UK c_s) + q_pe_t . k_pe_s = (W_UK^T q_nope_t) . c_s + q_pe_t . k_pe_s
    out_t = W_UV sum_s p(t, s) c_s

so each head's query is taken into latent space (q_latent = W_UK^T q_nope), attention runs as multi-query
attention with one "KV head" of [c_kv, k_pe] whose value is its first kv_lora_rank values
(paged_latent_attention), and W_UV takes the latent output back to the head's value. Prefill and decode go the
same way, so a token's bits do not depend on which it was computed in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from serval.runner.attention.backend import StepAttention, paged_latent_attention
from serval.runner.layers import Linear, RMSNorm, RopeTables
from serval.runner.models.arch import ArchConfig, RopeScaling
from serval.runner.quantization import is_placeholder

if TYPE_CHECKING:
    from serval.runner.lora import LoraBatch

# transformers' DeepseekV2/V3RMSNorm on q_a and kv_a is built with its default eps, not the config's.
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the config gives mscale_all_dim
    (transformers' yarn_apply_mscale): DeepSeek scales the logits here, beside the rotary tables' own factor."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    def __init__(self, arch: ArchConfig, index: int):
        super().__init__()
        mla = arch.mla
        self.num_heads = arch.num_heads
        self.kv_lora_rank, self.rope_dim = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.nope_dim, self.v_head_dim = mla.qk_nope_head_dim, mla.v_head_dim
        self.rope_interleave = mla.rope_interleave
        q_size = arch.num_heads * mla.qk_head_dim
        self.has_q_lora = mla.q_lora_rank is not None  # the query through q_a_proj, its norm, q_b_proj
        if not self.has_q_lora:
            self.q_proj = Linear(arch.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = Linear(arch.hidden_size, mla.q_lora_rank, bias=arch.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(arch.hidden_size, mla.latent_dim, bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, arch.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), False
        )
        self.o_proj = Linear(arch.num_heads * mla.v_head_dim, arch.hidden_size, bias=arch.attention_bias)
        self.scale = mla_softmax_scale(mla.qk_head_dim, arch.rope_scaling)
        # kv_b_proj split per head, made on first use (after loading): (num_heads, qk_nope, kv_lora_rank) and
        # (num_heads, v_head, kv_lora_rank) in the compute dtype
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        # kernels.dense_linear_heads, set by use_kernels; None: torch.bmm
        self.heads_kernel = None
        self._w_uk_rows: torch.Tensor | None = None  # (num_heads, kv_lora_rank, qk_nope): W_UK^T per head

    def use_kernels(self, kernels) -> None:
        """The absorbed per-head products through kernels.dense_linear_heads (after loading): each head's rows
        summed over K in one order whatever the number of tokens, so a token's bits never depend on its
        step's size, and a decode's 16 small products are one parallel call (torch.bmm took ~110 us for the
        2 MB of bf16 W_UK at one token, under 20 GB/s)."""
        self.heads_kernel = kernels.dense_linear_heads
        w_uk, w_uv = self.absorbed()
        self._w_uk_rows = w_uk.transpose(1, 2).contiguous()
        self._absorbed = (self._w_uk_rows.transpose(1, 2), w_uv)  # one copy of W_UK kept, not two

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK, W_UV): kv_b_proj's rows per head, dequantized once when only its packed form is kept."""
        if self._absorbed is None:
            proj = self.kv_b_proj
            weight = proj.weight
            if is_placeholder(weight):
                weight = proj.packed.rows(torch.arange(proj.out_features)).to(weight.dtype)
            per_head = weight.detach().view(
                self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank
            )
            w_uk, w_uv = per_head.split([self.nope_dim, self.v_head_dim], dim=1)
            self._absorbed = (w_uk.contiguous(), w_uv.contiguous())
        return self._absorbed

    def forward(
        self,
        x: torch.Tensor,  # (num_tokens, hidden_size)
        rope: RopeTables,
        cache: torch.Tensor,  # (num_slots, 1, kv_lora_rank + rope_dim): the layer's latent cache
        meta: StepAttention,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # (num_tokens, hidden_size)
        num_tokens = x.shape[0]
        if self.has_q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, lora)), lora)
        else:
            q = self.q_proj(x, lora)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x, lora).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # (num_tokens, kv_lora_rank)
        q_pe, k_pe = rope.apply(self._halves(q_pe), self._halves(k_pe.unsqueeze(1)))
        w_uk, w_uv = self.absorbed()
        if self.heads_kernel is not None:
            q_latent = self.heads_kernel(q_nope.transpose(0, 1), self._w_uk_rows)
        else:
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # (num_heads, num_tokens, kv_lora_rank)
        query = torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1)  # (num_tokens, num_heads, latent_dim)
        latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # (num_tokens, 1, latent_dim)
        out = paged_latent_attention(query, latent, cache, meta, self.scale, self.kv_lora_rank)
        if self.heads_kernel is not None:
            out = self.heads_kernel(out.transpose(0, 1), w_uv)
        else:
            out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # (num_heads, num_tokens, v_head_dim)
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.v_head_dim), lora)

    def _halves(self, x: torch.Tensor) -> torch.Tensor:  # (num_tokens, heads, rope_dim), contiguous
        # The checkpoint's pairs (x0, x1), (x2, x3) ... become halves (x0, x2, ...), (x1, x3, ...), which the
        # neox rotary tables turn: the same rotation, and q and k permuted alike leave every score unchanged.
        if self.rope_interleave:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return x.contiguous()
