"""The Triton attention backend (CUDA's) against the SDPA reference, on CPU tensors under Triton's interpreter.

fp32 (the interpreter has no bf16): decode-only, prefill-only and mixed steps over scattered block tables, with
cached prefixes that end mid-block and on block boundaries, several block sizes (powers of two and not), GQA
groups of 1, 3 and 4, head sizes that are and are not powers of two, sliding windows and sink logits.
"""

from __future__ import annotations

import pytest
import torch

from serval.runner.attention.backend import StepAttention, StepLayout, padded_block_tables, paged_attention
from serval.runner.attention.sdpa import SdpaBackend
from serval.runner.attention.selector import select_attention_backend
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("triton_interpreter")

# (new tokens, cached tokens) per sequence.
STEPS = {
    "decode_only": [(1, 9), (1, 3), (1, 7), (1, 0)],
    "prefill_only": [(7, 0), (20, 0), (5, 11)],
    "mixed": [(1, 9), (7, 0), (5, 6), (1, 31), (17, 16)],
    "chunk_after_long_prefix": [(3, 45), (1, 46)],
}
# gpt-oss's attention: a window shorter than most contexts (it cuts off cached prefixes), sink logits.
ATTENTION = {"plain": (0, False), "window": (4, False), "sinks": (0, True), "window_and_sinks": (5, True)}
# (num_heads, num_kv_heads, head_dim, block_size). The decode kernel's key tile follows the group and head
# size: 64 keys for the first three, 8 (under a block) for the last.
SHAPES = {
    "gqa3": (6, 2, 32, 4),
    "mha_bs16": (4, 4, 16, 16),
    "gqa4_d24_bs5": (8, 2, 24, 5),
    "gqa8_d128_bs16": (16, 2, 128, 16),
}


def _run_step(backend, steps, shape, window, with_sinks, seed=0, dtype=torch.float32):
    num_heads, num_kv_heads, head_dim, block_size = shape
    generator = torch.Generator().manual_seed(seed)
    num_new = [n for n, _ in steps]
    num_computed = [c for _, c in steps]
    blocks_per_seq = [-(-(n + c) // block_size) for n, c in steps]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start : start + count])
        start += count
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(k_cache.shape, generator=generator)
    total = sum(num_new)
    q = torch.randn(total, num_heads, head_dim, generator=generator)
    k = torch.randn(total, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(k.shape, generator=generator)
    sinks = torch.randn(num_heads, generator=generator) * 2 if with_sinks else None
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    layout = StepLayout(num_new, num_computed, padded_block_tables(tables), block_size, torch.device("cpu"))
    step = StepAttention.build(backend, layout)
    out = paged_attention(q, k, v, k_cache, v_cache, step, head_dim**-0.5, window, sinks)
    return out, k_cache, v_cache


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("step", list(STEPS))
def test_triton_backend_matches_sdpa(step, shape, attention):
    triton_backend = select_attention_backend(torch.device("cpu"), None, "triton")
    assert triton_backend.name == "triton"
    window, with_sinks = ATTENTION[attention]
    out, k_cache, v_cache = _run_step(triton_backend, STEPS[step], SHAPES[shape], window, with_sinks)
    expected, k_expected, v_expected = _run_step(
        SdpaBackend(), STEPS[step], SHAPES[shape], window, with_sinks
    )
    assert (out - expected).abs().max().item() < 1e-5
    # The new K/V went to the same slots (write_new_kv), and nothing else in the cache moved.
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("attention", list(ATTENTION))
def test_bf16_decodes_match_sdpa(attention):
    """The decode kernel loads and stores bf16 (computing in fp32) under the interpreter too; the prefill
    kernel's tl.dot over bf16 the interpreter gets wrong, so bf16 prefill is bench/gpu/'s to check."""
    backend = select_attention_backend(torch.device("cpu"), None, "triton")
    window, with_sinks = ATTENTION[attention]
    shape, step = SHAPES["gqa3"], STEPS["decode_only"]
    out, k_cache, _ = _run_step(backend, step, shape, window, with_sinks, dtype=torch.bfloat16)
    expected, k_expected, _ = _run_step(SdpaBackend(), step, shape, window, with_sinks, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max().item() < 2e-2
    assert torch.equal(k_cache, k_expected)


def test_strided_query_from_a_fused_projection():
    """q as the model passes it: a view of the fused qkv projection, rows strided past its K and V."""
    backend = select_attention_backend(torch.device("cpu"), None, "triton")
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    torch.manual_seed(1)
    tables = [[3, 1], [0, 2]]
    num_new, num_computed = [6, 1], [4, 9]
    qkv = torch.randn(sum(num_new), (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    caches = [torch.randn(4 * block_size, num_kv_heads, head_dim) for _ in range(2)]
    outs = []
    for b in (backend, SdpaBackend()):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        layout = StepLayout(
            num_new, num_computed, padded_block_tables(tables), block_size, torch.device("cpu")
        )
        outs.append(paged_attention(q, k, v, k_cache, v_cache, StepAttention.build(b, layout), 0.25))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("attention", list(ATTENTION))
def test_triton_backend_matches_sdpa_on_long_contexts(attention):
    """Longer prompts and contexts than the quick table: many key tiles and query blocks per sequence."""
    steps = [(150, 0), (1, 300), (64, 190), (1, 1), (33, 0)]
    window, with_sinks = ATTENTION[attention]
    window *= 20  # 80 and 100 keys: starts deep inside the contexts
    shape = (8, 2, 64, 16)
    backend = select_attention_backend(torch.device("cpu"), None, "triton")
    out, _, _ = _run_step(backend, steps, shape, window, with_sinks, seed=3)
    expected, _, _ = _run_step(SdpaBackend(), steps, shape, window, with_sinks, seed=3)
    assert (out - expected).abs().max().item() < 1e-5


def test_selector_refuses_what_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend(torch.device("cpu"), None, "triton")
    with pytest.raises(ValueError, match="native-cpu"):
        select_attention_backend(torch.device("cpu"), None, "native-cpu")
    with pytest.raises(ValueError, match="attention_backend must be"):
        select_attention_backend(torch.device("cpu"), None, "flash")
    assert isinstance(select_attention_backend(torch.device("cpu"), None, "sdpa"), SdpaBackend)
    # auto on the CPU never picks Triton (the native kernels, or SDPA without them).
    assert isinstance(select_attention_backend(torch.device("cpu"), None), SdpaBackend)
