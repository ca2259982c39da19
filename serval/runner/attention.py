"""Attention over the paged KV cache, in plain PyTorch (the reference backend).

The cache of one layer is two flat tensors of slots, (num_blocks * block_size, num_kv_heads, head_dim);
slot = block_id * block_size + offset. A step's tokens are flattened into one varlen batch. Everything that
depends only on the step (slot mapping, gather indices, masks) is built once in `AttentionMetadata.build`
and reused by every layer, so per-layer work is tensor ops only.

Sequences that compute one token (decodes) run through the native decode kernel (kernels/, reading the
cache in place) when it is built, else as one padded SDPA call over gathered K/V. Sequences that compute
several (prefill chunks) run through the native prefill kernel, all in one call, reading the cache in place
too; else one SDPA call each, causal with an offset when part of their context is already cached.

A layer may see only the last `window` positions up to each query's (gpt-oss's sliding layers) and add a
learned sink logit per head to every softmax's denominator (gpt-oss); the native kernels take both, the
PyTorch path masks and, with sinks, computes the softmax itself (SDPA has no sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSlice:
    token_start: int  # first row of this sequence's tokens in the flat batch
    num_new_tokens: int
    context_len: int  # cached tokens + new tokens
    context_slots: torch.Tensor | None  # (context_len,) slots of the whole context; None: no cached part
    mask: torch.Tensor | None  # (num_new_tokens, context_len) bool, True = may attend; None: plain causal


@dataclass
class NativePrefills:
    """The prefilling sequences of a step, as the native prefill kernel reads them."""

    block_tables: torch.Tensor  # (num_prefills, max_blocks) int64
    query_starts: torch.Tensor  # (num_prefills,) first row of each sequence's tokens in the flat batch
    query_lens: torch.Tensor  # (num_prefills,) new tokens
    context_lens: torch.Tensor  # (num_prefills,) cached + new tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) where each new token's K/V is written
    decode_rows: torch.Tensor | None  # (num_decodes,) rows of the flat batch that are single-token sequences
    decode_slots: torch.Tensor | None  # (num_decodes, max_context_len) slots to gather, padded with slot 0
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_context_len) bool, False on padding
    prefills: list[PrefillSlice]  # for the SDPA path; empty when native_prefills is set
    # With a native decode kernel, decodes read the cache in place through these instead of decode_slots:
    decode_kernel: Callable | None = None
    decode_block_tables: torch.Tensor | None = None  # (num_decodes, max_blocks) int64
    decode_context_lens: torch.Tensor | None = None  # (num_decodes,) int64
    block_size: int = 0
    is_decode_only: bool = False  # every sequence computes one token (the native DecodeStack's case)
    prefill_kernel: Callable | None = None
    native_prefills: NativePrefills | None = None

    @classmethod
    def build(
        cls,
        num_new_tokens: list[int],
        num_computed_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        decode_kernel: Callable | None = None,
        prefill_kernel: Callable | None = None,
    ) -> AttentionMetadata:
        if decode_kernel is not None and all(n == 1 for n in num_new_tokens):
            return cls._build_decode_only(
                num_computed_tokens, block_tables, block_size, device, decode_kernel
            )
        tables = _padded_tables(block_tables)  # (num_seqs, max_blocks), padded with 0
        new = torch.tensor(num_new_tokens)
        computed = torch.tensor(num_computed_tokens)
        context = new + computed
        slots, in_context = _context_slots(tables, context, block_size)
        positions = torch.arange(slots.shape[1])
        slot_mapping = slots[
            in_context & (positions >= computed[:, None])
        ]  # each sequence's new tokens in order

        decode_rows_t = decode_slots = decode_mask = decode_tables = decode_lens = None
        is_decode = new == 1
        if bool(is_decode.any()):
            starts = new.cumsum(0) - new
            decode_rows_t = starts[is_decode].to(device)
            if decode_kernel is not None:
                decode_tables = tables[is_decode].to(device)
                decode_lens = context[is_decode].to(device)
            else:
                max_len = int(context[is_decode].max())
                decode_slots = slots[is_decode, :max_len].to(device)
                decode_mask = in_context[is_decode, :max_len][:, None, None, :].to(device)
        native_prefills = None
        prefills: list[PrefillSlice] = []
        if prefill_kernel is not None and bool((new > 1).any()):
            native_prefills = _native_prefills(tables, new, context, device)
        elif bool((new > 1).any()):
            prefills = _sdpa_prefills(num_new_tokens, num_computed_tokens, slots, device)
        return cls(
            slot_mapping=slot_mapping.to(device),
            decode_rows=decode_rows_t,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_kernel=decode_kernel,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            block_size=block_size,
            is_decode_only=not prefills and native_prefills is None and decode_kernel is not None,
            prefill_kernel=prefill_kernel,
            native_prefills=native_prefills,
        )

    @classmethod
    def _build_decode_only(
        cls,
        num_computed_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        decode_kernel: Callable,
    ) -> AttentionMetadata:
        # The common step, built from lists in O(batch) without the general path's (num_seqs, max_context)
        # position tensors: it is per-token host work of every decode.
        max_blocks = max(len(t) for t in block_tables)
        slot_mapping = [
            table[position // block_size] * block_size + position % block_size
            for table, position in zip(block_tables, num_computed_tokens)
        ]
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_rows=torch.arange(len(block_tables), device=device),
            decode_slots=None,
            decode_mask=None,
            prefills=[],
            decode_kernel=decode_kernel,
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            decode_context_lens=torch.tensor(num_computed_tokens, dtype=torch.long, device=device) + 1,
            block_size=block_size,
            is_decode_only=True,
        )


def _padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """(num_seqs, max_blocks) block ids, each row padded with 0."""
    tables = torch.zeros(len(block_tables), max(len(t) for t in block_tables), dtype=torch.long)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    return tables


def _context_slots(
    tables: torch.Tensor, context: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every context position of every sequence as a cache slot, (num_seqs, max_context_len) with padding at
    slot 0, and which positions are in a sequence's context."""
    num_seqs, max_blocks = tables.shape
    max_context = int(context.max())
    positions = torch.arange(max_context).expand(num_seqs, max_context)
    in_context = positions < context[:, None]
    slots = tables.gather(1, (positions // block_size).clamp(max=max_blocks - 1)) * block_size
    return torch.where(in_context, slots + positions % block_size, 0), in_context


def _native_prefills(
    tables: torch.Tensor, new: torch.Tensor, context: torch.Tensor, device: torch.device
) -> NativePrefills:
    """The prefill chunks' rows (those with more than one new token) for the native prefill kernel."""
    is_prefill = new > 1
    starts = new.cumsum(0) - new
    return NativePrefills(
        block_tables=tables[is_prefill].to(device),
        query_starts=starts[is_prefill].to(device),
        query_lens=new[is_prefill].to(device),
        context_lens=context[is_prefill].to(device),
    )


def _sdpa_prefills(
    num_new_tokens: list[int], num_computed_tokens: list[int], slots: torch.Tensor, device: torch.device
) -> list[PrefillSlice]:
    prefills = []
    row = 0
    for i, (num_new, num_computed) in enumerate(zip(num_new_tokens, num_computed_tokens)):
        if num_new > 1 and num_computed == 0:
            prefills.append(PrefillSlice(row, num_new, num_new, None, None))
        elif num_new > 1:
            context_len = num_computed + num_new
            # Query i sits at position num_computed + i and sees keys 0..num_computed + i.
            q_pos = torch.arange(num_computed, context_len, device=device)
            k_pos = torch.arange(context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            context_slots = slots[i, :context_len].to(device)
            prefills.append(PrefillSlice(row, num_new, context_len, context_slots, mask))
        row += num_new
    return prefills


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), RoPE applied
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), RoPE applied
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # a query sees the last `window` positions up to its own; 0: its whole context
    sinks: torch.Tensor | None = None,  # (num_heads,) fp32 sink logits
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, k)  # index_copy_ is several times cheaper than index_put
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    paged = (-1, meta.block_size, num_kv_heads, head_dim)  # the same memory, seen as blocks
    native_sinks = _NO_SINKS if sinks is None else sinks
    if meta.decode_kernel is not None and meta.decode_rows is not None:
        out[meta.decode_rows] = meta.decode_kernel(
            q[meta.decode_rows],
            k_cache.view(paged),
            v_cache.view(paged),
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            window,
            native_sinks,
        )
    elif meta.decode_rows is not None:
        q_dec = q[meta.decode_rows].unsqueeze(2)  # (num_decodes, num_heads, 1, head_dim)
        k_dec = k_cache[meta.decode_slots].transpose(1, 2)  # (num_decodes, num_kv_heads, max_len, head_dim)
        v_dec = v_cache[meta.decode_slots].transpose(1, 2)
        mask = meta.decode_mask
        if window:  # slots are the context in order: key j is position j, the query the last one
            key_positions = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (key_positions > mask.sum(-1, keepdim=True) - 1 - window)
        out[meta.decode_rows] = _attend(q_dec, k_dec, v_dec, mask, scale, sinks).squeeze(2)
    if meta.native_prefills is not None:
        n = meta.native_prefills
        meta.prefill_kernel(
            q, k_cache.view(paged), v_cache.view(paged), n.block_tables, n.query_starts, n.query_lens,
            n.context_lens, scale, out, window, native_sinks,
        )  # fmt: skip
    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_new_tokens)
        q_p = q[rows].transpose(0, 1)  # (num_heads, num_new, head_dim)
        if p.context_slots is None:
            k_p, v_p = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            k_p = k_cache[p.context_slots].transpose(0, 1)  # (num_kv_heads, context_len, head_dim)
            v_p = v_cache[p.context_slots].transpose(0, 1)
        if p.mask is None and not window and sinks is None:
            o = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = _attend(q_p, k_p, v_p, _prefill_mask(p, window, q.device), scale, sinks)
        out[rows] = o.transpose(0, 1)
    return out


_NO_SINKS = torch.empty(0)  # the native kernels' "no sink logits"


def _prefill_mask(p: PrefillSlice, window: int, device: torch.device) -> torch.Tensor:
    """(num_new_tokens, context_len) bool: the keys each new token sees, causal and within the window."""
    q_pos = torch.arange(p.context_len - p.num_new_tokens, p.context_len, device=device)[:, None]
    k_pos = torch.arange(p.context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def _attend(
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
