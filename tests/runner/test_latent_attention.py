"""Latent attention (MLA's absorbed form): multi-query attention over one cache tensor whose rows are both the
key and, in their first value_dim values, the value. The native kernels (every variant) and the SDPA reference
agree with dense attention and with each other, write the same rows, and answer a query bitwise alike decoded
or in any prefill chunk."""

from __future__ import annotations

import pytest
import torch

from serval.runner.attention.backend import (
    StepAttention,
    StepLayout,
    padded_block_tables,
    paged_latent_attention,
)
from serval.runner.attention.native_cpu import NativeCpuBackend
from serval.runner.attention.sdpa import SdpaBackend
from tests.fixtures.kernels import VARIANT_NAMES, require_kernels
from tests.runner.test_attention import STEPS, _dense_reference

NUM_HEADS, BLOCK_SIZE, NUM_BLOCKS = 4, 4, 64
# (key row, value): DeepSeek's 512 + 64 (the kernels' register path) and a small latent (their plain path)
LATENTS = {"deepseek": (576, 512), "small": (48, 32)}


@pytest.mark.parametrize("latent", list(LATENTS))
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", [None, *VARIANT_NAMES])  # None: the SDPA reference backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_step_matches_dense_attention(step, variant, dtype, latent):
    backend = SdpaBackend() if variant is None else NativeCpuBackend(require_kernels(variant))
    head_dim, value_dim = LATENTS[latent]
    torch.manual_seed(0)
    num_new, num_computed = STEPS[step]
    perm = torch.randperm(NUM_BLOCKS).tolist()
    tables = [perm[0:3], perm[3:5], perm[5:8]]
    cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, 1, head_dim, dtype=dtype)
    total = sum(num_new)
    q = torch.randn(total, NUM_HEADS, head_dim, dtype=dtype)
    latent_rows = torch.randn(total, 1, head_dim, dtype=dtype)
    layout = StepLayout(num_new, num_computed, padded_block_tables(tables), BLOCK_SIZE, torch.device("cpu"))
    scale = 0.1
    out = paged_latent_attention(
        q, latent_rows, cache, StepAttention.build(backend, layout), scale, value_dim
    )
    assert out.shape == (total, NUM_HEADS, value_dim)
    row = 0
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for n, c, table in zip(num_new, num_computed, tables):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c + n)]
        keys = cache[slots]
        expected = _dense_reference(q[row : row + n], keys, keys[..., :value_dim], c, scale=scale)
        assert (out[row : row + n].float() - expected).abs().max().item() < tol
        assert torch.equal(cache[slots[c:]], latent_rows[row : row + n])  # the new rows were written
        row += n


@pytest.mark.parametrize("latent", list(LATENTS))
def test_both_backends_agree_on_a_latent_mixed_step(kernels, latent):
    head_dim, value_dim = LATENTS[latent]
    torch.manual_seed(1)
    num_new, num_computed = STEPS["mixed"]
    layout = StepLayout(
        num_new,
        num_computed,
        padded_block_tables([[11, 3, 6], [0, 9], [4, 2, 13]]),
        BLOCK_SIZE,
        torch.device("cpu"),
    )
    q = torch.randn(sum(num_new), NUM_HEADS, head_dim)
    rows = torch.randn(sum(num_new), 1, head_dim)
    base = torch.randn(NUM_BLOCKS * BLOCK_SIZE, 1, head_dim)
    results = []
    for backend in (SdpaBackend(), NativeCpuBackend(kernels)):
        cache = base.clone()
        out = paged_latent_attention(q, rows, cache, StepAttention.build(backend, layout), 0.1, value_dim)
        results.append((out, cache))
    (out_ref, cache_ref), (out_native, cache_native) = results
    assert torch.equal(cache_ref, cache_native)
    assert (out_ref - out_native).abs().max().item() < 1e-4


@pytest.mark.parametrize("latent", list(LATENTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_latent_query_is_answered_alike_decoded_or_in_any_prefill_chunk(kernels, latent, dtype):
    """Batch invariance of the latent mode: as test_attention.py's, over one cache as K and V."""
    head_dim, value_dim = LATENTS[latent]
    torch.manual_seed(head_dim)
    num_heads, block_size, length = 4, 16, 70
    cache = torch.randn(16, block_size, 1, head_dim).to(dtype)
    table = torch.randperm(16)[:5].unsqueeze(0)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    scale, no_sinks = head_dim**-0.5, torch.empty(0)

    def chunk(start: int, size: int) -> torch.Tensor:
        out = torch.zeros(size, num_heads, value_dim, dtype=dtype)
        starts, sizes, ends = torch.tensor([0]), torch.tensor([size]), torch.tensor([start + size])
        rows = q[start : start + size].contiguous()
        kernels.paged_prefill_attention(
            rows, cache, cache, table, starts, sizes, ends, scale, out, 0, no_sinks
        )
        return out

    whole = chunk(0, length)
    assert torch.equal(torch.cat([chunk(0, 23), chunk(23, 30), chunk(53, 17)]), whole)
    assert torch.equal(torch.cat([chunk(i, 1) for i in range(length)]), whole)
    decoded = torch.cat([
        kernels.paged_decode_attention(q[i : i + 1].contiguous(), cache, cache, table, torch.tensor([i + 1]),
                                       scale, 0, no_sinks, value_dim)
        for i in range(length)
    ])  # fmt: skip
    assert torch.equal(decoded, whole)
