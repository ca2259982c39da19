"""The reference attention backend: PyTorch's scaled_dot_product_attention over gathered K/V.

Runs on any device torch runs on, and is the oracle the native backends are tested against. Decodes (one new
token) run as one padded SDPA call over their gathered contexts; prefill chunks one SDPA call each, causal
with an offset when part of their context is already cached. A sliding window is a mask; sink logits
(gpt-oss) need the softmax computed here, since SDPA has no sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serval.runner.attention.backend import (
    FusedDecodeInputs,
    StepLayout,
    context_slots,
    new_token_slots,
    write_new_kv,
)
from serval.runner.attention.cache_dtype import as_cached, gathered, store_rows


@dataclass(frozen=True)
class PrefillSlice:
    token_start: int  # first row of this sequence's tokens in the flat batch
    num_new_tokens: int
    context_len: int  # cached tokens + new tokens
    context_slots: torch.Tensor | None  # (context_len,) slots of the whole context; None: no cached part


@dataclass(frozen=True)
class SdpaMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) where each new token's K/V is written
    decode_rows: torch.Tensor | None  # (num_decodes,) rows of the flat batch that are single-token sequences
    decode_slots: torch.Tensor | None  # (num_decodes, max_context_len) slots to gather, padded with slot 0
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_context_len) bool, False on padding
    prefills: list[PrefillSlice]


class SdpaBackend:
    name = "sdpa"

    def build(self, layout: StepLayout) -> SdpaMetadata:
        device = layout.device
        slots, in_context = context_slots(layout)
        new, context = layout.new_counts, layout.context_lens
        decode_rows = decode_slots = decode_mask = None
        is_decode = new == 1
        if bool(is_decode.any()):
            decode_rows = (new.cumsum(0) - new)[is_decode].to(device)
            max_len = int(context[is_decode].max())
            decode_slots = slots[is_decode, :max_len].to(device)
            decode_mask = in_context[is_decode, :max_len][:, None, None, :].to(device)
        prefills, row = [], 0
        for i, (num_new, num_computed) in enumerate(zip(layout.num_new_tokens, layout.num_computed_tokens)):
            if num_new > 1:
                cached = None if num_computed == 0 else slots[i, : num_computed + num_new].to(device)
                prefills.append(PrefillSlice(row, num_new, num_computed + num_new, cached))
            row += num_new
        return SdpaMetadata(
            new_token_slots(layout, slots, in_context).to(device),
            decode_rows,
            decode_slots,
            decode_mask,
            prefills,
        )

    def fused_decode_inputs(self, metadata: SdpaMetadata) -> FusedDecodeInputs | None:
        return None  # the fused decode is native: it reads the cache through the native backend's tables

    def forward(
        self, q, k, v, k_cache, v_cache, metadata: SdpaMetadata, scale, window, sinks
    ) -> torch.Tensor:
        write_new_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        k, v = as_cached(k, k_cache, metadata.slot_mapping), as_cached(v, v_cache, metadata.slot_mapping)
        return self._attend(q, k, v, k_cache, v_cache, metadata, scale, window, sinks)

    def forward_latent(self, q, latent, cache, metadata: SdpaMetadata, scale, value_dim) -> torch.Tensor:
        store_rows(latent, cache, metadata.slot_mapping)
        latent = as_cached(latent, cache, metadata.slot_mapping)
        # Views, not copies: a key row's first value_dim values are its value (SDPA takes a narrower V).
        values, cached_values = latent[..., :value_dim], cache[..., :value_dim]
        return self._attend(q, latent, values, cache, cached_values, metadata, scale, 0, None)

    def _attend(
        self, q, k, v, k_cache, v_cache, metadata: SdpaMetadata, scale, window, sinks
    ) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if metadata.decode_rows is not None:
            rows = metadata.decode_rows
            q_dec = q[rows].unsqueeze(2)  # (num_decodes, num_heads, 1, head_dim)
            k_dec = gathered(k_cache, metadata.decode_slots, q.dtype).transpose(
                1, 2
            )  # (num_decodes, num_kv_heads, len, head_dim)
            v_dec = gathered(v_cache, metadata.decode_slots, q.dtype).transpose(1, 2)
            mask = metadata.decode_mask
            if window:  # slots are the context in order: key j is position j, the query the last one
                key_positions = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (key_positions > mask.sum(-1, keepdim=True) - 1 - window)
            out[rows] = attend(q_dec, k_dec, v_dec, mask, scale, sinks).squeeze(2)
        for p in metadata.prefills:
            rows = slice(p.token_start, p.token_start + p.num_new_tokens)
            q_p = q[rows].transpose(0, 1)  # (num_heads, num_new, head_dim)
            if p.context_slots is None:
                k_p, v_p = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                # (num_kv_heads, context_len, head_dim)
                k_p = gathered(k_cache, p.context_slots, q.dtype).transpose(0, 1)
                v_p = gathered(v_cache, p.context_slots, q.dtype).transpose(0, 1)
            if p.context_slots is None and not window and sinks is None:
                o = F.scaled_dot_product_attention(
                    q_p, k_p, v_p, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                o = attend(q_p, k_p, v_p, _prefill_mask(p, window, q.device), scale, sinks)
            out[rows] = o.transpose(0, 1)
        return out


def _prefill_mask(p: PrefillSlice, window: int, device: torch.device) -> torch.Tensor:
    """(num_new_tokens, context_len) bool: the keys each new token sees, causal and within the window."""
    q_pos = torch.arange(p.context_len - p.num_new_tokens, p.context_len, device=device)[:, None]
    k_pos = torch.arange(p.context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def attend(
    q: torch.Tensor,  # (..., num_heads, num_queries, head_dim)
    k: torch.Tensor,  # (..., num_kv_heads, num_keys, head_dim)
    v: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcast to (..., num_queries, num_keys): True = may attend
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # The sink is one more logit in each row's softmax whose value is zero: its share is dropped.
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3).float(), v.repeat_interleave(group, dim=-3).float()
    scores = (q.float() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink_column = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return (probs @ v).to(q.dtype)
