"""The CUDA attention backend: Triton kernels (triton_kernels.py) over the paged KV cache, read in place.

A step's decodes (one new token) go to the decode kernel with their block tables and context lengths; its
prefill chunks (a fresh prompt, or a chunk after a cached prefix) go to the varlen prefill kernel in one
launch. Both take a sliding window and sink logits, as the native CPU backend does. The new K/V is written
first (write_new_kv), so a chunk's own keys are read from the cache like its prefix's.

The metadata is built on the host from the StepLayout and copied to the device once per step (small int32
tensors); no launch reads a host value that a device result decides, so nothing here synchronizes.

It runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (CI's check, against the SDPA reference;
the selector forces it there on request: `attention_backend="triton"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from serval.runner.attention.backend import FusedDecodeInputs, StepLayout, write_new_kv
from serval.runner.attention.cache_dtype import row_scales

# Key positions per iteration of the prefill kernel's loop, and query rows per prefill program. 16 is tl.dot's
# smallest tile on NVIDIA GPUs.
PREFILL_BLOCK_M = 16
PREFILL_BLOCK_N = 32
# The decode kernel's (group, keys, head_dim) broadcast product: its keys per iteration are sized so that it
# holds at most this many values (64 fp32 registers a thread over 4 warps).
DECODE_TILE_ELEMENTS = 8192


@dataclass(frozen=True)
class TritonDecodes:
    """The step's single-token sequences, as the decode kernel reads them (device int32 tensors)."""

    rows: torch.Tensor  # (num_decodes,) each one's row in the step's flat batch
    block_tables: torch.Tensor  # (num_decodes, max_blocks)
    context_lens: torch.Tensor  # (num_decodes,) cached + the new token


@dataclass(frozen=True)
class TritonPrefills:
    """The step's multi-token sequences, as the prefill kernel reads them (device int32 tensors)."""

    block_tables: torch.Tensor  # (num_prefills, max_blocks)
    query_starts: torch.Tensor  # (num_prefills,) first row of each one's new tokens in the flat batch
    query_lens: torch.Tensor  # (num_prefills,) new tokens
    context_lens: torch.Tensor  # (num_prefills,) cached + new tokens
    max_query_len: int  # from the layout (a host int): sizes the launch grid without reading the device


@dataclass(frozen=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64, where each new token's K/V is written
    block_size: int
    decodes: TritonDecodes | None
    prefills: TritonPrefills | None


def build_triton_metadata(layout: StepLayout) -> TritonMetadata:
    """The step's addressing, computed on the host from the layout, then moved to the device."""
    device, block_size = layout.device, layout.block_size
    tables = layout.block_tables
    new, computed, context = layout.new_counts, layout.computed_counts, layout.context_lens
    starts = new.cumsum(0) - new
    # Each new token's slot: its position's block in its sequence's table.
    seq_of_token = torch.repeat_interleave(torch.arange(len(new)), new)
    positions = torch.arange(int(new.sum())) - starts[seq_of_token] + computed[seq_of_token]
    blocks = tables[seq_of_token, positions // block_size]
    slot_mapping = (blocks * block_size + positions % block_size).to(device)

    def on_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).to(device)

    decodes = prefills = None
    is_decode = new == 1
    if bool(is_decode.any()):
        decodes = TritonDecodes(
            on_device(starts[is_decode]), on_device(tables[is_decode]), on_device(context[is_decode])
        )
    is_prefill = new > 1
    if bool(is_prefill.any()):
        prefills = TritonPrefills(
            block_tables=on_device(tables[is_prefill]),
            query_starts=on_device(starts[is_prefill]),
            query_lens=on_device(new[is_prefill]),
            context_lens=on_device(context[is_prefill]),
            max_query_len=int(new[is_prefill].max()),
        )
    return TritonMetadata(slot_mapping, block_size, decodes, prefills)


class TritonPagedBackend:
    name = "triton"

    def build(self, layout: StepLayout) -> TritonMetadata:
        return build_triton_metadata(layout)

    def fused_decode_inputs(self, metadata: TritonMetadata) -> FusedDecodeInputs | None:
        return None  # the fused whole-model decode is the native CPU kernels'

    def forward(
        self, q, k, v, k_cache, v_cache, metadata: TritonMetadata, scale, window, sinks
    ) -> torch.Tensor:
        write_new_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.decodes is not None:
            paged_decode(
                q, k_cache, v_cache, metadata.decodes, metadata.block_size, scale, window, sinks, out
            )
        if metadata.prefills is not None:
            paged_prefill(
                q, k_cache, v_cache, metadata.prefills, metadata.block_size, scale, window, sinks, out
            )
        return out


def _kernel_shape(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The constexprs both kernels take from the tensors' shapes; checks the strides they assume (V is
    addressed with K's strides)."""
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the Triton attention kernels need unit-stride head dimensions and K, V alike")
    head_dim = q.shape[2]
    return {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": max(16, triton.next_power_of_2(head_dim)),  # tl.dot's smallest K on GPUs
        "GROUP": q.shape[1] // k_cache.shape[1],
    }


def paged_decode(q, k_cache, v_cache, d: TritonDecodes, block_size, scale, window, sinks, out) -> None:
    """out[d.rows] = each decode's attention over its cached context (q, out: (num_tokens, H, D))."""
    from serval.runner.attention.triton_kernels import paged_decode_kernel

    shape = _kernel_shape(q, k_cache, v_cache)
    group_padded = triton.next_power_of_2(shape["GROUP"])
    block_n = min(64, max(8, DECODE_TILE_ELEMENTS // (group_padded * shape["HEAD_DIM_PADDED"])))
    num_decodes, num_kv_heads = d.rows.shape[0], k_cache.shape[1]
    paged_decode_kernel[(num_decodes, num_kv_heads)](
        out, q, k_cache, v_cache, *_scales_args(k_cache, v_cache), d.block_tables, d.context_lens, d.rows,
        _sink_arg(sinks, q),
        scale, window, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), d.block_tables.stride(0),
        BLOCK_N=block_n, GROUP_PADDED=group_padded, HAS_SINKS=sinks is not None,
        INT8=k_cache.dtype == torch.int8, **shape,
    )  # fmt: skip


def paged_prefill(q, k_cache, v_cache, p: TritonPrefills, block_size, scale, window, sinks, out) -> None:
    """out[rows of each prefill] = its new tokens' causal attention over cached prefix + themselves."""
    from serval.runner.attention.triton_kernels import paged_prefill_kernel

    shape = _kernel_shape(q, k_cache, v_cache)
    grid = (p.query_lens.shape[0], triton.cdiv(p.max_query_len, PREFILL_BLOCK_M), q.shape[1])
    paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, *_scales_args(k_cache, v_cache), p.block_tables, p.query_starts, p.query_lens,
        p.context_lens,
        _sink_arg(sinks, q), scale, window, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), p.block_tables.stride(0),
        BLOCK_N=PREFILL_BLOCK_N, BLOCK_M=PREFILL_BLOCK_M, HAS_SINKS=sinks is not None,
        # fp32 products in fp32 (not TF32: the fp32 path is the exact one); 16-bit inputs take the default
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, INT8=k_cache.dtype == torch.int8, **shape,
    )  # fmt: skip


def _scales_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's row scales (cache_dtype.row_scales); else the caches themselves, which INT8=False never
    reads through."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache
    return row_scales(k_cache), row_scales(v_cache)


def _sink_arg(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks pointer: fp32 on q's device; without sinks q itself, which HAS_SINKS=False never
    reads through it (no allocation per layer)."""
    if sinks is None:
        return q
    return sinks.to(device=q.device, dtype=torch.float32)
