"""What the KV cache holds: the compute dtype, or one byte a value (`CacheConfig.kv_cache_dtype`).

- "fp8_e5m2" (or "fp8", as vLLM's CPU backend takes it): each value rounded to fp8 e5m2 (2 mantissa bits).
- "int8": each (token, kv head) row of head_dim values as int8 codes and one fp32 scale (max |x| / 127) in
  the row's 4 extra bytes, as llama.cpp's q8_0 cache keeps a scale a block: the row is the block. More precise
  than e5m2 for the same bytes (docs/benchmarks.md); the cache's rows are 4 bytes wider than head_dim.

Every write rounds the new K/V rows to the cache's form here (`store_rows`; the native kernels' `store_cache_rows`
writes the same bytes), and every read widens them back (`widened`; the native kernels widen as they load, with
the same products). A backend that attends over a prompt's fresh K/V instead of reading them back from the
cache rounds them the same way first (`as_cached`), so that a prompt's own keys are the values its later
decodes read: greedy output stays a function of the request, not of how its tokens were batched.
"""

from __future__ import annotations

import torch

INT8_ROW_SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype's tensor dtype: "auto" keeps the compute dtype; "fp8" is e5m2, as vLLM's CPU
    backend takes it."""
    return {"fp8": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}.get(
        name, compute_dtype
    )


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """A cache row's elements: head_dim values, and an int8 row's scale."""
    return head_dim + (INT8_ROW_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows (n, heads, head_dim) into cache[slot_mapping], in the cache's form where it is narrower. index_copy_
    is several times cheaper than index_put."""
    if cache.dtype == torch.int8:
        rows = quantize_rows(rows)
    elif rows.dtype != cache.dtype:
        rows = rows.to(cache.dtype)
    cache_storage(cache).index_copy_(0, slot_mapping, cache_storage(rows))


def cache_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or an 8-bit float t's bytes: torch has no CPU index_copy_ for fp8, and a copy by bytes is the same."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e5m2 else t


def quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) values as int8 rows (..., head_dim + 4): codes round-to-even(x * (1 / scale)), then the
    scale max|x| * fp32(1/127) as 4 bytes. A row of zeros has scale 0 and codes 0."""
    x = rows.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax * torch.tensor(1.0 / 127.0, dtype=torch.float32)
    inverse = torch.where(amax > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(x * inverse).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows (..., head_dim + 4) as fp32 values (..., head_dim): code * scale."""
    codes, scale = rows[..., :-INT8_ROW_SCALE_BYTES], rows[..., -INT8_ROW_SCALE_BYTES:]
    return codes.float() * scale.contiguous().view(torch.float32)


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in the compute dtype (an fp8 cache's values widen exactly; an int8 row's are code * scale)."""
    if t.dtype == torch.int8:
        return dequantize_rows(t).to(dtype)
    return t if t.dtype == dtype else t.to(dtype)


def as_cached(new: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The step's new K/V rows as the cache holds them (what the native kernels see: they read every key from
    the cache)."""
    if cache.dtype == torch.int8:
        return dequantize_rows(quantize_rows(new)).to(new.dtype)
    return new if cache.dtype == new.dtype else new.to(cache.dtype).to(new.dtype)
