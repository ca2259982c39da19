"""The Triton kernels of the CUDA attention backend (triton_paged.py): paged decode and varlen prefill.

Both read the flat paged cache in place, (num_slots, num_kv_heads, head_dim) with slot = block * block_size +
offset, a tile of BLOCK_N context positions per iteration of their key loop (each position's block looked up
in the sequence's table, so a tile may span blocks of any size), and run an online softmax in fp32
(FlashAttention's rescaling), so no K/V is gathered into padded copies. Both take a sliding window (a query
at position p sees keys p - window + 1 .. p; 0: its whole context) and per-head sink logits (gpt-oss: one
more logit in each row's softmax, whose value is zero). The sink enters as the running maximum's and sum's
starting values: a softmax over [sink, scores] is then exactly what the loop accumulates.

They run on a GPU, and on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported: its
decorator picks the interpreter then), which is how CI tests them against the SDPA reference, in fp32 (the
interpreter computes tl.dot over bf16 wrongly).

An int8 cache (`--kv-cache-dtype int8`) is read as codes times each row's fp32 scale (the scales that follow
the codes in the cache's buffer, cache_dtype.row_scales), K and V then in q's dtype as the SDPA reference
gathers them.

NOTE: tl.arange needs power-of-two lengths: head_dim is padded to HEAD_DIM_PADDED with masked lanes; the
cache's block size is a plain argument (any size), since tiles are positions, not blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A finite "minus infinity" for the running maximum: exp(-inf - (-inf)) would be NaN on a row that has seen
# only masked keys so far (a padding row, or the tiles before a window's start). A constexpr: a jitted
# function may read no other kind of global.
_NEG_LARGE = tl.constexpr(-1.0e30)


@triton.jit
def _load_tile(
    k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_ptr, key_pos, key_mask, block_size, kv_head,
    dims, dim_mask, stride_cache_slot, stride_cache_head, INT8: tl.constexpr,
):  # fmt: skip
    """(N, D) K and V of one KV head at context positions key_pos, through the sequence's block table
    (table_ptr: its row); masked positions read as zeros. INT8: codes times their rows' scales, in fp32."""
    block_ids = tl.load(table_ptr + key_pos // block_size, mask=key_mask, other=0).to(tl.int64)
    slots = block_ids * block_size + key_pos % block_size
    offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
    mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    if INT8:  # a row's scale: one per (slot, kv head), in the rows' order
        rows = slots * (stride_cache_slot // stride_cache_head) + kv_head
        k = k.to(tl.float32) * tl.load(k_scales_ptr + rows, mask=key_mask, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(v_scales_ptr + rows, mask=key_mask, other=0.0)[:, None]
    return k, v


@triton.jit
def _softmax_start(sinks_ptr, heads, head_mask, NUM_ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The running maximum and sum of NUM_ROWS rows (of query heads `heads`) before any key: with sinks, the
    sink's logit and exp(0) = 1, so that the loop computes the softmax over [sink, scores]; else -inf, 0."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=head_mask, other=_NEG_LARGE).to(tl.float32)
        l_i = tl.where(head_mask, 1.0, 0.0)
    else:
        m_i = tl.full((NUM_ROWS,), _NEG_LARGE, tl.float32)
        l_i = tl.zeros((NUM_ROWS,), tl.float32)
    return m_i, l_i


@triton.jit
def _online_softmax(scores, m_i, l_i):
    """One tile of the online softmax over (rows, N) masked scores: (p, alpha, new maximum, new sum); the
    caller rescales its accumulator by alpha before adding p's products."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, context_lens_ptr,
    rows_ptr, sinks_ptr,
    scale, window, block_size,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_slot, stride_cache_head, stride_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr, HAS_SINKS: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """One program per (decoding sequence, KV head): the GROUP query heads that share the KV head attend to
    its context together, so each cache tile is read once per KV head, not once per query head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + seq)  # this sequence's row in the step's flat batch
    context_len = tl.load(context_lens_ptr + seq)

    heads = kv_head * GROUP + tl.arange(0, GROUP_PADDED)  # (G,) the query heads of this KV head
    head_mask = tl.arange(0, GROUP_PADDED) < GROUP
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    q_offsets = row * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # (G, D)
    m_i, l_i = _softmax_start(sinks_ptr, heads, head_mask, GROUP_PADDED, HAS_SINKS)
    acc = tl.zeros((GROUP_PADDED, HEAD_DIM_PADDED), tl.float32)

    first_key = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    offsets = tl.arange(0, BLOCK_N)
    for tile in range(first_key // BLOCK_N, tl.cdiv(context_len, BLOCK_N)):
        key_pos = tile * BLOCK_N + offsets  # (N,)
        key_mask = (key_pos < context_len) & (key_pos >= first_key)
        k, v = _load_tile(
            k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_table, key_pos,
            key_mask, block_size, kv_head, dims, dim_mask, stride_cache_slot, stride_cache_head, INT8,
        )  # fmt: skip
        if INT8:  # as the SDPA reference gathers them: in q's dtype
            k, v = k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty)
        # NOTE: a broadcast product, not tl.dot: the group is often under tl.dot's 16 rows, and a decode is
        # bound by reading the cache, not by these multiplies.
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # (G, N)
        p, alpha, m_i, l_i = _online_softmax(tl.where(key_mask[None, :], scores, float("-inf")), m_i, l_i)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)

    o_offsets = row * stride_o_token + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, query_starts_ptr,
    query_lens_ptr, context_lens_ptr, sinks_ptr,
    scale, window, block_size,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_slot, stride_cache_head, stride_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INT8: tl.constexpr,
):  # fmt: skip
    """One program per (prefilling sequence, block of BLOCK_M of its new tokens, query head). The new
    tokens' K/V are already in the cache (write_new_kv), so a chunk after a cached prefix and a fresh
    prompt are one case: queries at positions cached..context-1, causal over the whole context."""
    seq = tl.program_id(0)
    query_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    query_len = tl.load(query_lens_ptr + seq)
    if query_block * BLOCK_M >= query_len:
        return  # the grid is sized for the longest chunk of the step
    query_start = tl.load(query_starts_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    num_cached = context_len - query_len

    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,) indices among this sequence's new tokens
    row_mask = rows < query_len
    query_pos = num_cached + rows
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    q_offsets = (query_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)  # (M, D)
    # Every row is this head: its sink (if any) starts each row's softmax.
    m_i, l_i = _softmax_start(sinks_ptr, head + 0 * rows, rows >= 0, BLOCK_M, HAS_SINKS)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)

    # The keys any row of this block may see: from the first row's window start to the last row's position.
    end_key = tl.minimum(num_cached + query_block * BLOCK_M + BLOCK_M, context_len)
    first_key = tl.where(window > 0, tl.maximum(num_cached + query_block * BLOCK_M - window + 1, 0), 0)
    offsets = tl.arange(0, BLOCK_N)
    for tile in range(first_key // BLOCK_N, tl.cdiv(end_key, BLOCK_N)):
        key_pos = tile * BLOCK_N + offsets  # (N,)
        k, v = _load_tile(
            k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_table, key_pos,
            key_pos < end_key, block_size, kv_head, dims, dim_mask, stride_cache_slot, stride_cache_head, INT8,
        )  # fmt: skip
        if INT8:  # tl.dot takes like dtypes: q's, as the SDPA reference gathers K and V
            k, v = k.to(q.dtype), v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # (M, N)
        visible = (key_pos[None, :] <= query_pos[:, None]) & row_mask[:, None]
        if window > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        p, alpha, m_i, l_i = _online_softmax(tl.where(visible, scores, float("-inf")), m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)

    # A padding row saw no key: its sum is 0 (or 1 with a sink), and it is not stored.
    o_offsets = (query_start + rows)[:, None] * stride_o_token + head * stride_o_head + dims[None, :]
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
