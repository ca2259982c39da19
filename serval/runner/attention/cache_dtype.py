"""What the KV cache holds: the compute dtype, or one byte a value (`CacheConfig.kv_cache_dtype="fp8_e5m2"`).

Every write rounds the new K/V rows to the cache's dtype with torch's rounding (`store_rows`; the native
kernels' `store_cache_rows` writes the same bytes), and every read widens them exactly (`widened`; the native
kernels widen as they load). A backend that attends over a prompt's fresh K/V instead of reading them back from
the cache rounds them the same way first (`as_cached`), so that a prompt's own keys are the values its later
decodes read: greedy output stays a function of the request, not of how its tokens were batched.
"""

from __future__ import annotations

import torch

EIGHT_BIT_DTYPES = (torch.float8_e5m2,)


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype's tensor dtype: "auto" keeps the compute dtype; "fp8" is e5m2, as vLLM's CPU
    backend takes it."""
    return torch.float8_e5m2 if name in ("fp8", "fp8_e5m2") else compute_dtype


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows into cache[slot_mapping], rounded to the cache's dtype where it is narrower. index_copy_ is several
    times cheaper than index_put."""
    if rows.dtype != cache.dtype:
        rows = rows.to(cache.dtype)
    cache_storage(cache).index_copy_(0, slot_mapping, cache_storage(rows))


def cache_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or an 8-bit float t's bytes: torch has no CPU index_copy_ for fp8, and a copy by bytes is the same."""
    return t.view(torch.uint8) if t.dtype in EIGHT_BIT_DTYPES else t


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in the compute dtype (an 8-bit cache's values widen exactly)."""
    return t if t.dtype == dtype else t.to(dtype)


def as_cached(new: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The step's new K/V rows as the cache holds them: rounded through an 8-bit cache's dtype (what the native
    kernels see: they read every key from the cache)."""
    return new if cache.dtype == new.dtype else new.to(cache.dtype).to(new.dtype)
