"""The native CPU attention backend: the kernels in kernels/ read the paged cache in place.

Decodes (one new token) go to the decode kernel with their block tables and context lengths; every prefill
chunk of the step goes to the prefill kernel in one call. Both take a sliding window and sink logits. A
decode-only step is built in O(batch) tensor ops from the layout's block tables, without the general path's
(num_seqs, max_context) position tensors: it is host work of every decode, and it is also what the fused
whole-model decode (models/decode_stack.py) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serval.runner.attention.backend import (
    FusedDecodeInputs,
    StepLayout,
    context_slots,
    new_token_slots,
)

_NO_SINKS = torch.empty(0)  # the kernels' "no sink logits"


@dataclass(frozen=True)
class NativePrefills:
    """The prefilling sequences of a step, as the prefill kernel reads them."""

    block_tables: torch.Tensor  # (num_prefills, max_blocks) int64
    query_starts: torch.Tensor  # (num_prefills,) first row of each sequence's tokens in the flat batch
    query_lens: torch.Tensor  # (num_prefills,) new tokens
    context_lens: torch.Tensor  # (num_prefills,) cached + new tokens


@dataclass(frozen=True)
class NativeMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) where each new token's K/V is written
    block_size: int
    decode_rows: torch.Tensor | None  # (num_decodes,) rows of the flat batch that are single-token sequences
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks) int64
    decode_context_lens: torch.Tensor | None  # (num_decodes,) int64
    prefills: NativePrefills | None
    is_decode_only: bool


class NativeCpuBackend:
    name = "native-cpu"

    def __init__(self, kernels):
        self.decode_kernel = kernels.paged_decode_attention
        self.prefill_kernel = kernels.paged_prefill_attention
        self.store_kernel = kernels.store_cache_rows

    def build(self, layout: StepLayout) -> NativeMetadata:
        if layout.is_decode_only:
            return _decode_only(layout)
        device = layout.device
        tables = layout.block_tables
        slots, in_context = context_slots(layout)
        new, context = layout.new_counts, layout.context_lens
        starts = new.cumsum(0) - new
        decode_rows = decode_tables = decode_lens = None
        is_decode = new == 1
        if bool(is_decode.any()):
            decode_rows = starts[is_decode].to(device)
            decode_tables = tables[is_decode].to(device)
            decode_lens = context[is_decode].to(device)
        is_prefill = new > 1
        prefills = None
        if bool(is_prefill.any()):
            prefills = NativePrefills(
                block_tables=tables[is_prefill].to(device),
                query_starts=starts[is_prefill].to(device),
                query_lens=new[is_prefill].to(device),
                context_lens=context[is_prefill].to(device),
            )
        slot_mapping = new_token_slots(layout, slots, in_context).to(device)
        return NativeMetadata(
            slot_mapping, layout.block_size, decode_rows, decode_tables, decode_lens, prefills, False
        )

    def fused_decode_inputs(self, metadata: NativeMetadata) -> FusedDecodeInputs | None:
        if not metadata.is_decode_only:
            return None
        return FusedDecodeInputs(
            metadata.slot_mapping, metadata.decode_block_tables, metadata.decode_context_lens
        )

    def forward(
        self, q, k, v, k_cache, v_cache, metadata: NativeMetadata, scale, window, sinks
    ) -> torch.Tensor:
        self._store(k, k_cache, metadata.slot_mapping)
        self._store(v, v_cache, metadata.slot_mapping)
        return self._attend(q, k_cache, v_cache, metadata, scale, window, sinks, q.shape[-1])

    def forward_latent(self, q, latent, cache, metadata: NativeMetadata, scale, value_dim) -> torch.Tensor:
        self._store(latent, cache, metadata.slot_mapping)
        # One tensor as K and V: the kernels read a token's value from the start of its key row.
        return self._attend(q, cache, cache, metadata, scale, 0, None, value_dim)

    def _store(self, rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The new rows into their slots by the kernel: a row copy each, an 8-bit cache's rounding in one pass
        (the same bytes as cache_dtype.store_rows; its torch ops cost an int8 prefill step several ms)."""
        if rows.stride(-1) != 1 or rows.stride(-2) != rows.shape[-1]:
            rows = rows.contiguous()
        self.store_kernel(rows, cache, slot_mapping)

    def _attend(self, q, k_cache, v_cache, metadata: NativeMetadata, scale, window, sinks, value_dim):
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        paged = (-1, metadata.block_size, num_kv_heads, head_dim)  # the same memory, seen as blocks
        native_sinks = _NO_SINKS if sinks is None else sinks
        if metadata.is_decode_only:  # every row a decode: no gather of q, no scatter of the output
            return self.decode_kernel(
                q.contiguous(), k_cache.view(paged), v_cache.view(paged), metadata.decode_block_tables,
                metadata.decode_context_lens, scale, window, native_sinks, value_dim,
            )  # fmt: skip
        out = q.new_empty(*q.shape[:-1], value_dim)
        if metadata.decode_rows is not None:
            out[metadata.decode_rows] = self.decode_kernel(
                q[metadata.decode_rows], k_cache.view(paged), v_cache.view(paged),
                metadata.decode_block_tables, metadata.decode_context_lens, scale, window, native_sinks,
                value_dim,
            )  # fmt: skip
        if metadata.prefills is not None:
            p = metadata.prefills
            self.prefill_kernel(
                q, k_cache.view(paged), v_cache.view(paged), p.block_tables, p.query_starts, p.query_lens,
                p.context_lens, scale, out, window, native_sinks,
            )  # fmt: skip
        return out


def _decode_only(layout: StepLayout) -> NativeMetadata:
    device, block_size = layout.device, layout.block_size
    tables = layout.block_tables
    computed = layout.computed_counts
    blocks = tables.gather(1, (computed // block_size).unsqueeze(1)).squeeze(1)
    slot_mapping = blocks * block_size + computed % block_size
    return NativeMetadata(
        slot_mapping=slot_mapping.to(device),
        block_size=block_size,
        decode_rows=torch.arange(len(layout.num_computed_tokens), device=device),
        decode_block_tables=tables.to(device),
        decode_context_lens=(computed + 1).to(device),
        prefills=None,
        is_decode_only=True,
    )
