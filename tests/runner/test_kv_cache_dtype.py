"""An 8-bit KV cache (`--kv-cache-dtype fp8_e5m2`) in the native kernels, every instruction-set variant: the cache
writes round each value exactly as torch's `.to(torch.float8_e5m2)` does, and the attention kernels read an
8-bit cache as they read the same values widened to the compute dtype, bit for bit."""

from __future__ import annotations

import pytest
import torch

from serval.runner.attention.cache_dtype import store_rows
from tests.runner.test_attention import GPT_OSS

# Values at the format's edges: zeros, subnormals of e5m2 (below 2^-14) and of nothing (below 2^-17, which
# round to zero or to the smallest subnormal), ties to even, the largest finite value (57344) and the
# values that round to it or to infinity (from 61440 on), infinities and NaN.
EDGES = [0.0, -0.0, 1e-8, -1e-8, 2**-14, 2**-15, 2**-16, 2**-17, 1.5 * 2**-16, 3 * 2**-17, 3e-5, 6.1e-5,
         1.125, 1.375, 1.0625, -2.625, 57344.0, 57345.0, 61439.0, 61440.0, 65535.0, 65536.0, 1e6, -1e6,
         float("inf"), float("-inf"), float("nan")]  # fmt: skip


def _cache_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_writes_round_as_torch_does(kernels, dtype):
    torch.manual_seed(0)
    values = torch.cat(
        [torch.randn(2000) * scale for scale in (1e-6, 1e-3, 1.0, 1e3, 3e4)] + [torch.tensor(EDGES)]
    )
    rows = values[: values.numel() // 48 * 48].to(dtype).view(-1, 3, 16)
    cache = torch.zeros(2 * rows.shape[0], 3, 16, dtype=torch.float8_e5m2)
    slots = torch.randperm(cache.shape[0])[: rows.shape[0]]
    kernels.store_cache_rows(rows, cache, slots)
    assert torch.equal(_cache_bytes(cache[slots]), _cache_bytes(rows.to(torch.float8_e5m2)))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not _cache_bytes(cache[untouched]).any()
    # Rows as the model hands them over (a strided view of the fused qkv output), 30 values a row: the
    # vector loop's tail.
    qkv = torch.randn(33, 70).to(dtype)
    k = qkv[:, 10:40].view(33, 3, 10)
    narrow_cache = torch.zeros(40, 3, 10, dtype=torch.float8_e5m2)
    kernels.store_cache_rows(k, narrow_cache, torch.arange(33) + 7)
    assert torch.equal(_cache_bytes(narrow_cache[7:]), _cache_bytes(k.to(torch.float8_e5m2)))
    # The PyTorch backends' write (backend.store_rows) gives the same bytes.
    torch_cache = torch.zeros_like(narrow_cache)
    store_rows(k, torch_cache, torch.arange(33) + 7)
    assert torch.equal(_cache_bytes(torch_cache), _cache_bytes(narrow_cache))


def test_a_cache_of_another_dtype_is_refused(kernels):
    rows = torch.randn(2, 3, 16)
    with pytest.raises(RuntimeError, match="fp8 e5m2"):
        kernels.store_cache_rows(rows, torch.zeros(4, 3, 16, dtype=torch.float16), torch.tensor([0, 1]))
    q = torch.randn(1, 6, 32)
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="q's dtype or fp8 e5m2"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([3]), 0.1)


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # 48: both kernels' plain paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_an_8bit_cache_as_its_widened_values(kernels, head_dim, dtype, attention):
    """Decode (a batch of many sequences) and prefill (chunks after cached prefixes) over an fp8 cache give
    bitwise what they give over the same values widened to q's dtype: the widening is exact, and the
    arithmetic is the 16/32-bit path's."""
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    num_seqs = 8 * torch.get_num_threads() + 3
    cache_8bit = (torch.randn(num_seqs * 6, block_size, num_kv_heads, head_dim) * 2).to(torch.float8_e5m2)
    values_8bit = torch.randn_like(cache_8bit, dtype=torch.float32).to(torch.float8_e5m2)
    k_wide, v_wide = cache_8bit.to(dtype), values_8bit.to(dtype)
    tables = torch.randperm(num_seqs * 6).view(num_seqs, 6)
    lengths = torch.randint(1, 6 * block_size, (num_seqs,))
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    window, with_sinks = GPT_OSS[attention]
    window *= 7
    sinks = torch.randn(num_heads) if with_sinks else torch.empty(0)
    scale = head_dim**-0.5

    def decode(k_cache, v_cache):
        return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, window, sinks)

    assert torch.equal(decode(cache_8bit, values_8bit), decode(k_wide, v_wide))

    query_lens = torch.minimum(lengths, torch.tensor(20))
    query_starts = query_lens.cumsum(0) - query_lens
    prefill_q = torch.randn(int(query_lens.sum()), num_heads, head_dim).to(dtype)

    def prefill(k_cache, v_cache):
        out = torch.zeros_like(prefill_q)
        kernels.paged_prefill_attention(
            prefill_q, k_cache, v_cache, tables, query_starts, query_lens, lengths, scale, out, window, sinks
        )
        return out

    assert torch.equal(prefill(cache_8bit, values_8bit), prefill(k_wide, v_wide))


def test_latent_attention_reads_an_8bit_cache(kernels):
    """MLA's absorbed attention (a 576-wide latent row, its first 512 the value) over one 8-bit tensor."""
    torch.manual_seed(5)
    latent_8bit = torch.randn(24, 16, 1, 576).to(torch.float8_e5m2)
    tables = torch.randperm(24).view(4, 6)
    lengths = torch.tensor([1, 17, 50, 96])
    q = torch.randn(4, 8, 576).to(torch.bfloat16)
    wide = latent_8bit.to(torch.bfloat16)
    got = kernels.paged_decode_attention(
        q, latent_8bit, latent_8bit, tables, lengths, 0.05, 0, torch.empty(0), 512
    )
    want = kernels.paged_decode_attention(q, wide, wide, tables, lengths, 0.05, 0, torch.empty(0), 512)
    assert torch.equal(got, want)
