"""What the KV cache holds: the compute dtype, bf16, or one byte a value (`CacheConfig.kv_cache_dtype`).

- "bfloat16": each value rounded to bf16 (to nearest even, as torch's .to rounds) where the compute dtype is
  wider: half an fp32 cache's bytes, for CPUs without bf16 arithmetic (AVX2), where "auto" is fp32.

- "fp8_e5m2" (or "fp8", as vLLM's CPU backend takes it): each value rounded to fp8 e5m2 (2 mantissa bits).
- "int8": each (token, kv head) row of head_dim values as int8 codes and one fp32 scale (max |x| / 127), as
  llama.cpp's q8_0 cache keeps a scale a block (the row is the block). The cache tensor holds the codes and
  its buffer goes on past them with the scales, a row each in the rows' order (`row_scales`), so that every
  path that moves slots of the tensor moves codes alone and a row stays head_dim bytes (one cache line at 64).
  More precise than e5m2 for 4 more bytes a row (docs/benchmarks.md).

Every write rounds the new K/V rows to the cache's form here (`store_rows`; the native kernels'
`store_cache_rows` writes the same bytes), and every read widens them back (`gathered`; the native kernels widen
as they load, with the same products). A backend that attends over a prompt's fresh K/V instead of reading the
cache takes them back as the cache holds them (`as_cached`), so that a prompt's own keys are the values
its later decodes read: greedy output stays a function of the request, not of how its tokens were batched.
"""

from __future__ import annotations

import math
import mmap

import torch


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype's tensor dtype: "auto" keeps the compute dtype; "fp8" is e5m2, as vLLM's CPU
    backend takes it."""
    named = {
        "bfloat16": torch.bfloat16,
        "fp8": torch.float8_e5m2,
        "fp8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
    }
    return named.get(name, compute_dtype)


def check_cache_dtype_runs(name: str, compute_dtype: torch.dtype, backend: str, is_latent: bool) -> None:
    """Refuse at start-up what does not read a narrower cache: fp8, and bf16 under another compute dtype, on the
    Triton kernels (they read int8 rows or the model's dtype), and an int8 latent (MLA) cache on the SDPA
    backend (its value view of the latent rows would lose the scales' place)."""
    narrower = name in ("fp8", "fp8_e5m2") or (name == "bfloat16" and compute_dtype != torch.bfloat16)
    if narrower and backend == "triton":
        raise ValueError(
            f"kv_cache_dtype={name!r} runs on the native-cpu and sdpa attention backends; the Triton kernels "
            "read int8 rows or the model's dtype"
        )
    if name == "int8" and backend == "sdpa" and is_latent:
        raise ValueError("kv_cache_dtype='int8' with latent attention (MLA) runs on the native-cpu backend")


def bytes_per_row(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's bytes: head_dim values, and an int8 row's scale."""
    return head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)


def empty_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor; an int8 one with its scales after it in the same buffer. On the CPU an anonymous
    mapping, not torch.zeros, which writes every byte: the OS hands out zero pages as slots are first written,
    so resident memory follows the blocks in use, not the budget. (Not calloc either: once the loader has freed
    a large buffer, glibc serves allocations of up to 32 MB from its heap, and calloc then clears them.) The
    mapping is page-aligned, so a 128-byte K row spans two cache lines, not three. Private, not mmap's default
    shared mapping: a shared one is shmem, whose first write to a page costs the page cache's bookkeeping too
    (a fresh engine's 64-row decode steps wrote their new K/V rows in 1.3 ms a step, 0.9 private; 0.3 once
    every page had been written)."""
    num_values = math.prod(shape)
    num_bytes = num_values * dtype.itemsize + (4 * num_values // shape[-1] if dtype == torch.int8 else 0)
    if device.type != "cpu":
        buffer = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    else:
        mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    return buffer[: num_values * dtype.itemsize].view(dtype).view(shape)


def row_scales(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's scales, (*cache.shape[:-1]) fp32: the buffer past its codes (empty_cache)."""
    rows = cache.numel() // cache.shape[-1]
    start = cache.storage_offset() + cache.numel()
    scales = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), start, (rows * 4,)
    )
    return scales.view(torch.float32).view(cache.shape[:-1])


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows (n, heads, head_dim) into cache[slot_mapping], in the cache's form where it is narrower. index_copy_
    is several times cheaper than index_put."""
    sources = quantize_rows(rows) if cache.dtype == torch.int8 else slot_views(rows.to(cache.dtype))
    for target, source in zip(slot_views(cache), sources, strict=True):
        target.index_copy_(0, slot_mapping, source)


def slot_views(cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors that hold a cache's slots, indexed alike on dim 0: the cache (an fp8 one as bytes: torch has
    no CPU index_copy_ for fp8), and an int8 cache's scales."""
    if cache.dtype == torch.float8_e5m2:
        return (cache.view(torch.uint8),)
    if cache.dtype == torch.int8:
        return (cache, row_scales(cache))
    return (cache,)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., head_dim) values as int8 codes round-to-even(x * (1 / scale)) and their rows' scales
    max|x| * fp32(1/127), (...). A row of zeros has scale 0 and codes 0."""
    x = rows.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax * torch.tensor(1.0 / 127.0, dtype=torch.float32)
    inverse = torch.where(amax > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(x * inverse).clamp(-127, 127).to(torch.int8)
    return codes, scale.squeeze(-1)


def dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes (..., head_dim) and their rows' scales (...) as fp32 values: code * scale, the kernels'
    products."""
    return codes.float() * scales.unsqueeze(-1)


def int8_cache_of(values: torch.Tensor) -> torch.Tensor:
    """values (..., head_dim) as an int8 cache tensor (its scales after it): for benchmarks and tests."""
    cache = empty_cache(tuple(values.shape), torch.int8, values.device)
    codes, scales = quantize_rows(values)
    cache.copy_(codes)
    row_scales(cache).copy_(scales)
    return cache


def widened(cache: torch.Tensor) -> torch.Tensor:
    """A whole cache's values in fp32 (an int8 one's code * scale)."""
    return dequantized(cache, row_scales(cache)) if cache.dtype == torch.int8 else cache.float()


def gathered(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in the compute dtype (an fp8 cache's values widen exactly; an int8 row's are code * scale,
    in fp32 first as the kernels form them)."""
    rows = cache[index]
    if cache.dtype == torch.int8:
        return dequantized(rows, row_scales(cache)[index]).to(dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


def as_cached(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The step's new K/V rows, just stored at slot_mapping, as the cache holds them (what the native kernels
    see: they read every key from the cache): read back, not rounded a second time."""
    return new if cache.dtype == new.dtype else gathered(cache, slot_mapping, new.dtype)
