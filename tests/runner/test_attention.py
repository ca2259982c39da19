"""Paged attention: the native decode and prefill kernels and the PyTorch paths agree with dense attention,
with and without a sliding window and per-head sink logits (gpt-oss)."""

from __future__ import annotations

import pytest
import torch

from serval.runner.attention.backend import StepAttention, StepLayout, padded_block_tables, paged_attention
from serval.runner.attention.native_cpu import NativeCpuBackend
from serval.runner.attention.sdpa import SdpaBackend
from serval.runner.attention.selector import select_attention_backend
from tests.fixtures.kernels import VARIANT_NAMES, require_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 32, 4, 64


def _dense_reference(q, k_ctx, v_ctx, num_computed, window=0, sinks=None, scale=HEAD_DIM**-0.5):
    """q: (num_new, H, D) at positions num_computed.., k/v: (context, KVH, D), as transformers' eager
    attention computes it (gpt-oss's: the sink logit joins each row's softmax, its share dropped)."""
    context = k_ctx.shape[0]
    q_pos = torch.arange(num_computed, num_computed + q.shape[0])[:, None]
    k_pos = torch.arange(context)[None, :]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    group = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, context, D)
    v = v_ctx.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :context]
    return (probs @ v).transpose(0, 1)


# Three sequences: a decode with 9 cached tokens, a fresh prefill of 7, a chunk of 5 after 6 cached; and a
# decode-only step (its own metadata path) with contexts ending mid-block and on a block boundary.
STEPS = {"mixed": ([1, 7, 5], [9, 0, 6]), "decode_only": ([1, 1, 1], [9, 3, 7])}


# gpt-oss's attention: a window shorter than the contexts (it cuts off the cached prefixes), sink logits.
GPT_OSS = {"plain": (0, False), "window": (4, False), "sinks": (0, True), "window_and_sinks": (3, True)}


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", [None, *VARIANT_NAMES])  # None: the SDPA reference backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_dense_attention(step, variant, dtype, attention):
    backend = SdpaBackend() if variant is None else NativeCpuBackend(require_kernels(variant))
    torch.manual_seed(0)
    num_new, num_computed = STEPS[step]
    perm = torch.randperm(NUM_BLOCKS).tolist()
    tables = [perm[0:3], perm[3:5], perm[5:8]]
    k_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    total = sum(num_new)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, dtype=dtype)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    v = torch.randn_like(k)
    window, with_sinks = GPT_OSS[attention]
    sinks = torch.randn(NUM_HEADS) * 2 if with_sinks else None
    layout = StepLayout(num_new, num_computed, padded_block_tables(tables), BLOCK_SIZE, torch.device("cpu"))
    meta = StepAttention.build(backend, layout)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, window, sinks)
    row = 0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for n, c, table in zip(num_new, num_computed, tables):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c + n)]
        expected = _dense_reference(q[row : row + n], k_cache[slots], v_cache[slots], c, window, sinks)
        assert (out[row : row + n].float() - expected).abs().max().item() < tol
        # The new tokens' K/V were written into their slots.
        assert torch.equal(k_cache[slots[c:]], k[row : row + n])
        row += n


def _scattered_block_tables(lens: list[int], block_size: int, num_blocks: int):
    """Each sequence's blocks, drawn without repeats from a shuffled pool: (lists, padded int64 tensor)."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start : start + count])
        start += count
    max_blocks = max(blocks_per_seq)
    return tables, torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 take the register-tiled path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_kernel_matches_dense_attention_at_every_tile_boundary(kernels, head_dim, dtype, attention):
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 64
    # Context lengths around the kernel's tiles (8 tokens on AVX2, 16 on AVX-512), and one longer than a few
    # blocks.
    lens = [1, 7, 8, 9, 15, 16, 17, 33, 300]
    tables, block_tables = _scattered_block_tables(lens, block_size, num_blocks)
    k_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim) * 3).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    window, with_sinks = GPT_OSS[attention]
    window *= 5  # 20 and 15 keys: windows that start mid-block and mid-tile, past the shorter contexts
    sinks = torch.randn(num_heads) * 3 if with_sinks else torch.empty(0)
    out = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(lens), scale, window, sinks
    )
    for i, (n, table) in enumerate(zip(lens, tables)):
        k_ctx = k_cache[table].flatten(0, 1)[:n]  # (n, KVH, D)
        v_ctx = v_cache[table].flatten(0, 1)[:n]
        expected = _dense_reference(
            q[i : i + 1], k_ctx, v_ctx, n - 1, window, sinks if with_sinks else None, scale
        )[0]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (out[i].float() - expected).abs().max().item() < tol, (n, dtype)
    # q as the DecodeStack passes it: the q part of fused qkv rows, rows apart, read in place.
    qkv = torch.cat([q.flatten(1), torch.randn(len(lens), 2 * num_kv_heads * head_dim).to(dtype)], dim=1)
    in_place = qkv[:, : num_heads * head_dim].view(len(lens), num_heads, head_dim)
    assert not in_place.is_contiguous()
    strided = kernels.paged_decode_attention(
        in_place, k_cache, v_cache, block_tables, torch.tensor(lens), scale, window, sinks
    )
    assert torch.equal(strided, out)


# 48 takes the plain path; 32, 64 and 128 the tiled one (4 rows at a time, fewer for wider heads).
@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_kernel_matches_dense_attention_around_its_blocks(kernels, head_dim, dtype, attention):
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 64
    # (new tokens, cached tokens): around the 16-row query blocks and the 8- or 16-key tiles, after cached
    # prefixes that end mid-tile and on a tile boundary, one longer than several blocks.
    shapes = [(2, 0), (7, 1), (15, 0), (16, 5), (17, 16), (33, 31), (140, 100)]
    lens = [n + c for n, c in shapes]
    tables, block_tables = _scattered_block_tables(lens, block_size, num_blocks)
    k_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim) * 3).to(dtype)
    v_cache = torch.randn_like(k_cache)
    query_lens = torch.tensor([n for n, _ in shapes])
    query_starts = query_lens.cumsum(0) - query_lens
    # q as the model passes it: a strided view of the fused qkv projection.
    qkv = torch.randn(int(query_lens.sum()), (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    window, with_sinks = GPT_OSS[attention]
    window *= 5  # 20 and 15 keys: shorter than most rows' contexts, starting mid-tile
    sinks = torch.randn(num_heads) * 3 if with_sinks else torch.empty(0)
    kernels.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_starts, query_lens, torch.tensor(lens), scale, out, window, sinks
    )  # fmt: skip
    for (n, c), table, row in zip(shapes, tables, query_starts.tolist()):
        k_ctx = k_cache[table].flatten(0, 1)[: n + c]
        v_ctx = v_cache[table].flatten(0, 1)[: n + c]
        expected = _dense_reference(
            q[row : row + n], k_ctx, v_ctx, c, window, sinks if with_sinks else None, scale
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (out[row : row + n].float() - expected).abs().max().item() < tol, (n, c, dtype)


def test_the_backend_is_chosen_by_device_and_kernels(kernels):
    assert isinstance(select_attention_backend(torch.device("cpu"), kernels), NativeCpuBackend)
    assert isinstance(select_attention_backend(torch.device("cpu"), None), SdpaBackend)
    # A device without a backend of its own runs the reference backend (selector.py); CUDA runs Triton's
    # (tests/runner/test_triton_attention.py).
    assert isinstance(select_attention_backend(torch.device("meta"), kernels), SdpaBackend)
    assert select_attention_backend(torch.device("cuda"), None).name == "triton"


@pytest.mark.parametrize("step", list(STEPS))
def test_only_a_native_decode_only_step_offers_the_fused_decode(kernels, step):
    num_new, num_computed = STEPS[step]
    tables = [[5, 9, 2], [7, 1], [3, 4, 8]]
    layout = StepLayout(num_new, num_computed, padded_block_tables(tables), BLOCK_SIZE, torch.device("cpu"))
    assert StepAttention.build(SdpaBackend(), layout).fused_decode is None
    fused = StepAttention.build(NativeCpuBackend(kernels), layout).fused_decode
    if step != "decode_only":
        assert fused is None
        return
    # Each sequence's new token goes to the slot of its position; the context counts it.
    expected_slots = [
        table[c // BLOCK_SIZE] * BLOCK_SIZE + c % BLOCK_SIZE for table, c in zip(tables, num_computed)
    ]
    assert fused.slot_mapping.tolist() == expected_slots
    assert fused.context_lens.tolist() == [c + 1 for c in num_computed]
    assert torch.equal(fused.block_tables, padded_block_tables(tables))


def test_both_backends_write_the_same_slots_and_agree_on_a_mixed_step(kernels):
    torch.manual_seed(1)
    num_new, num_computed = STEPS["mixed"]
    tables = [[11, 3, 6], [0, 9], [4, 2, 13]]
    layout = StepLayout(num_new, num_computed, padded_block_tables(tables), BLOCK_SIZE, torch.device("cpu"))
    total = sum(num_new)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM), torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    k_base = torch.randn(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_base = torch.randn_like(k_base)
    outputs = []
    for backend in (SdpaBackend(), NativeCpuBackend(kernels)):
        k_cache, v_cache = k_base.clone(), v_base.clone()
        step = StepAttention.build(backend, layout)
        outputs.append((paged_attention(q, k, v, k_cache, v_cache, step, HEAD_DIM**-0.5), k_cache, v_cache))
    (out_ref, k_ref, v_ref), (out_native, k_native, v_native) = outputs
    assert torch.equal(k_ref, k_native) and torch.equal(v_ref, v_native)
    assert (out_ref - out_native).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # 48 takes both kernels' plain paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_is_answered_alike_decoded_or_in_any_prefill_chunk(kernels, head_dim, dtype, attention):
    """Batch invariance: a query's output is bitwise the same whether it is decoded, computed in one prefill
    chunk with the whole prompt, in chunks split elsewhere, or in one-token chunks (a prefix-cache hit's last
    token, a chunk's remainder)."""
    torch.manual_seed(head_dim)
    # 150 keys: past the prefill kernel's first chunk of keys at every head size (128 keys at 32, 64 at 64, 32 at
    # 128), so that scores and sums go on across chunks.
    num_heads, num_kv_heads, block_size, length = 6, 2, 16, 150
    k_cache = torch.randn(16, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(16)[:10].unsqueeze(0)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    window, with_sinks = GPT_OSS[attention]
    window *= 7  # 28 and 21 keys: windows starting mid-tile
    sinks = torch.randn(num_heads) if with_sinks else torch.empty(0)
    scale = head_dim**-0.5

    def chunk(start: int, size: int) -> torch.Tensor:
        out = torch.zeros(size, num_heads, head_dim, dtype=dtype)
        starts, sizes, ends = torch.tensor([0]), torch.tensor([size]), torch.tensor([start + size])
        rows = q[start : start + size].contiguous()
        kernels.paged_prefill_attention(
            rows, k_cache, v_cache, table, starts, sizes, ends, scale, out, window, sinks
        )
        return out

    whole = chunk(0, length)
    assert torch.equal(torch.cat([chunk(0, 23), chunk(23, 30), chunk(53, 97)]), whole)
    assert torch.equal(torch.cat([chunk(i, 1) for i in range(length)]), whole)
    decoded = torch.cat([
        kernels.paged_decode_attention(q[i : i + 1].contiguous(), k_cache, v_cache, table, torch.tensor([i + 1]),
                                       scale, window, sinks)
        for i in range(length)
    ])  # fmt: skip
    assert torch.equal(decoded, whole)


@pytest.mark.parametrize("attention", list(GPT_OSS))
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # 48 takes the plain path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_decode_batch_answers_each_sequence_as_alone(kernels, head_dim, dtype, attention):
    """Batch invariance in a decode step of many sequences (the kernel's tasks shared out over the threads):
    every sequence's output is bitwise what it gets decoded alone, and matches dense attention."""
    torch.manual_seed(head_dim + 1)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    num_seqs = 8 * torch.get_num_threads() + 3  # several tasks a thread
    lengths = torch.randint(1, 60, (num_seqs,))
    k_cache = torch.randn(num_seqs * 4, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_seqs * 4).view(num_seqs, 4)
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    window, with_sinks = GPT_OSS[attention]
    sinks = torch.randn(num_heads) if with_sinks else torch.empty(0)
    scale = head_dim**-0.5
    batched = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, window, sinks)
    for i in range(num_seqs):
        alone = kernels.paged_decode_attention(
            q[i : i + 1].contiguous(),
            k_cache,
            v_cache,
            tables[i : i + 1],
            lengths[i : i + 1],
            scale,
            window,
            sinks,
        )
        assert torch.equal(batched[i : i + 1], alone)
        slots = tables[i].repeat_interleave(block_size) * block_size + torch.arange(4 * block_size).remainder(
            block_size
        )
        context = slots[: int(lengths[i])]
        k_ctx = k_cache.view(-1, num_kv_heads, head_dim)[context]
        v_ctx = v_cache.view(-1, num_kv_heads, head_dim)[context]
        reference = _dense_reference(q[i : i + 1], k_ctx, v_ctx, int(lengths[i]) - 1, window,
                                     sinks if with_sinks else None, scale)  # fmt: skip
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        assert (batched[i : i + 1].float() - reference).abs().max().item() < tolerance
