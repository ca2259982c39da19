"""Narrower KV caches in the native kernels, every instruction-set variant: the cache writes give exactly the
bytes of the PyTorch path (bf16 under fp32/fp16 rows and fp8 e5m2: torch's `.to()`; int8:
cache_dtype.quantize_rows' codes and scales, the scales after the codes in the cache's buffer), and the
attention kernels read such a cache as they read its values widened (bf16, fp8: to q's dtype; int8: code *
scale in fp32), bit for bit; decode stays bitwise equal to prefill over an int8 cache."""

from __future__ import annotations

import pytest
import torch

from serval.runner.attention.cache_dtype import empty_cache, int8_cache_of, row_scales, store_rows, widened
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bf16_cache_writes_round_as_torch_does(kernels, dtype):
    """`--kv-cache-dtype bfloat16` under fp32 (or fp16) compute: each value to nearest even, as torch's .to()
    rounds it; NaN stays NaN (torch's vector path writes 0xFFFF, c10's scalar one and the kernels 0x7FC0)."""
    torch.manual_seed(1)
    scales = (1e-30, 1e-6, 1.0, 1e3, 6e4) if dtype == torch.float16 else (1e-38, 1e-6, 1.0, 1e3, 1e30)
    # Ties: the 16 bits dropped are exactly 0x8000, with the kept bits' last bit odd and even.
    ties = torch.tensor([0x3F818000, 0x3F808000, 0x47008000], dtype=torch.int32).view(torch.float32)
    values = torch.cat([torch.tensor(EDGES), ties, -ties] + [torch.randn(2000) * scale for scale in scales])
    rows = values[: values.numel() // 30 * 30].to(dtype).view(-1, 3, 10)  # 30 values a row: the tails
    cache = torch.zeros(2 * rows.shape[0], 3, 10, dtype=torch.bfloat16)
    slots = torch.randperm(cache.shape[0])[: rows.shape[0]]
    kernels.store_cache_rows(rows, cache, slots)
    want = rows.to(torch.bfloat16)
    assert torch.equal(cache[slots].isnan(), want.isnan()) and want.isnan().any()
    numbers = ~want.isnan()
    assert torch.equal(cache[slots][numbers].view(torch.int16), want[numbers].view(torch.int16))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].view(torch.int16).any()
    # The PyTorch backends' write gives the same values.
    torch_cache = torch.zeros_like(cache)
    store_rows(rows, torch_cache, slots)
    assert torch.equal(torch_cache[slots][numbers].view(torch.int16), want[numbers].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 48, 28])  # 28: the vector loops' tails
def test_int8_rows_are_the_pytorch_paths_bytes(kernels, dtype, head_dim):
    torch.manual_seed(head_dim)
    # Rows from 1e-4 to 1e2 in scale (ties at x / scale = k + 0.5 are common in bf16), and a row of zeros.
    rows = (torch.randn(300, 3, head_dim) * torch.logspace(-4, 2, 300).view(300, 1, 1)).to(dtype)
    rows[7] = 0
    cpu = torch.device("cpu")
    cache, torch_cache = (
        empty_cache((320, 3, head_dim), torch.int8, cpu),
        empty_cache((320, 3, head_dim), torch.int8, cpu),
    )
    slots = torch.randperm(320)[:300]
    kernels.store_cache_rows(rows, cache, slots)
    store_rows(rows, torch_cache, slots)
    assert torch.equal(cache, torch_cache) and torch.equal(row_scales(cache), row_scales(torch_cache))
    # Each value within half a code of its row's scale; the zero row's scale and codes are zero; the slots
    # not written are still zero.
    error = (widened(cache)[slots] - rows.float()).abs()
    assert (error <= rows.float().abs().amax(-1, keepdim=True) / 254 * 1.0001).all()
    assert not cache[slots[7]].any() and not row_scales(cache)[slots[7]].any()
    untouched = torch.ones(320, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any() and not row_scales(cache)[untouched].any()


def test_a_cache_of_another_dtype_is_refused(kernels):
    rows = torch.randn(2, 3, 16)
    with pytest.raises(RuntimeError, match="fp8 e5m2"):
        kernels.store_cache_rows(rows, torch.zeros(4, 3, 16, dtype=torch.float16), torch.tensor([0, 1]))
    q = torch.randn(1, 6, 32)
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="q's dtype, bf16, fp8 e5m2 or int8 rows"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([3]), 0.1)
    bare_int8 = torch.zeros(4, 16, 2, 32, dtype=torch.int8)  # codes without the scales after them
    with pytest.raises(RuntimeError, match="a scale a row after them"):
        kernels.paged_decode_attention(q, bare_int8, bare_int8, torch.tensor([[0]]), torch.tensor([3]), 0.1)
    with pytest.raises(RuntimeError, match="a scale a row after them"):
        kernels.store_cache_rows(rows, torch.zeros(4, 3, 16, dtype=torch.int8), torch.tensor([0, 1]))


def _caches(kind: str, dtype: torch.dtype, shape: tuple[int, ...]):
    """(k, v) narrower caches of `kind` and the same values widened: to q's dtype (bf16 and fp8, exact), or to
    fp32 (int8 rows, code * scale: the kernels' own products, which q's dtype need not hold)."""
    k, v = torch.randn(shape) * 2, torch.randn(shape)
    narrow = {"bfloat16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2}.get(kind)
    if narrow is not None:
        k, v = k.to(narrow), v.to(narrow)
        return k, v, k.to(dtype), v.to(dtype)
    k, v = int8_cache_of(k), int8_cache_of(v)
    return k, v, widened(k), widened(v)


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # 48: both kernels' plain paths
@pytest.mark.parametrize(("kind", "dtype"), [("fp8_e5m2", torch.float32), ("fp8_e5m2", torch.bfloat16),
                                             ("int8", torch.float32), ("bfloat16", torch.float32),
                                             ("bfloat16", torch.float16)])  # fmt: skip
def test_attention_reads_a_narrower_cache_as_its_widened_values(kernels, head_dim, kind, dtype, attention):
    """Decode (a batch of many sequences) and prefill (chunks after cached prefixes) over a narrower cache give
    bitwise what they give over the same values widened: the widening is the kernels' own, and the arithmetic
    after it is the 16/32-bit path's."""
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    num_seqs = 8 * torch.get_num_threads() + 3
    k_narrow, v_narrow, k_wide, v_wide = _caches(
        kind, dtype, (num_seqs * 6, block_size, num_kv_heads, head_dim)
    )
    tables = torch.randperm(num_seqs * 6).view(num_seqs, 6)
    lengths = torch.randint(1, 6 * block_size, (num_seqs,))
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    window, with_sinks = GPT_OSS[attention]
    window *= 7
    sinks = torch.randn(num_heads) if with_sinks else torch.empty(0)
    scale = head_dim**-0.5

    def decode(k_cache, v_cache):
        return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, window, sinks)

    assert torch.equal(decode(k_narrow, v_narrow), decode(k_wide, v_wide))

    query_lens = torch.minimum(lengths, torch.tensor(20))
    query_starts = query_lens.cumsum(0) - query_lens
    prefill_q = torch.randn(int(query_lens.sum()), num_heads, head_dim).to(dtype)

    def prefill(k_cache, v_cache):
        out = torch.zeros_like(prefill_q)
        kernels.paged_prefill_attention(
            prefill_q, k_cache, v_cache, tables, query_starts, query_lens, lengths, scale, out, window, sinks
        )
        return out

    assert torch.equal(prefill(k_narrow, v_narrow), prefill(k_wide, v_wide))


@pytest.mark.parametrize("kind", ["fp8_e5m2", "int8", "bfloat16"])
def test_latent_attention_reads_a_narrower_cache(kernels, kind):
    """MLA's absorbed attention (a 576-wide latent row, its first 512 the value; an int8 row's scale after all
    576) over one narrower tensor."""
    torch.manual_seed(5)
    dtype = torch.bfloat16 if kind == "fp8_e5m2" else torch.float32
    latent_narrow, _, wide, _ = _caches(kind, dtype, (24, 16, 1, 576))
    tables = torch.randperm(24).view(4, 6)
    lengths = torch.tensor([1, 17, 50, 96])
    q = torch.randn(4, 8, 576).to(dtype)
    got = kernels.paged_decode_attention(
        q, latent_narrow, latent_narrow, tables, lengths, 0.05, 0, torch.empty(0), 512
    )
    want = kernels.paged_decode_attention(q, wide, wide, tables, lengths, 0.05, 0, torch.empty(0), 512)
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim", [48, 64])  # 48: the plain paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_over_an_int8_cache_is_answered_alike_decoded_or_in_a_prefill_chunk(kernels, head_dim, dtype):
    """Batch invariance over int8 rows: both kernels widen a row with the same products."""
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, length = 6, 2, 16, 70
    k_cache = int8_cache_of(torch.randn(16, block_size, num_kv_heads, head_dim))
    v_cache = int8_cache_of(torch.randn(16, block_size, num_kv_heads, head_dim))
    table = torch.randperm(16)[:5].unsqueeze(0)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    whole = torch.zeros(length, num_heads, head_dim, dtype=dtype)
    kernels.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        torch.tensor([0]),
        torch.tensor([length]),
        torch.tensor([length]),
        scale,
        whole,
    )
    decoded = torch.cat([
        kernels.paged_decode_attention(q[i : i + 1].contiguous(), k_cache, v_cache, table, torch.tensor([i + 1]), scale)
        for i in range(length)
    ])  # fmt: skip
    assert torch.equal(decoded, whole)
