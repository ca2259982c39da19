"""Packing a GGUF matrix's blocks into the quantized kernels' layout (runner/quantization.py), from its bytes.

The native kernels (kernels/gguf_repack.cpp) pack a matrix in one pass, and can pack the shards of a fused
matrix (q/k/v, gate/up) straight into its one set of buffers; without them tensor ops do it
(loader/dequant.py, runner/quantization.py), a large matrix in slices. Also here: llama.cpp's q/k row order,
undone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from serval.runner.loader.dequant import block_codes
from serval.runner.quantization import GROUP, PackedWeight, pack_block_codes

# Weights packed at a time from a large matrix's bytes: the intermediate codes (a byte a weight, and their
# regrouped copy) of a 49,152-row embedding would otherwise add ~0.6 GB to a 7B load's peak.
_PACK_CHUNK_WEIGHTS = 1 << 24


@dataclass(frozen=True)
class NativeRepack:
    """The native kernels that pack a GGUF matrix's bytes in one pass (kernels/gguf_repack.cpp), and where the
    shards of a fused matrix go: join_target(hf name, row width) gives the fused matrix's packed buffers and
    the shard's first group of 16 rows in them (the loader's packer owns them), or None to pack it alone."""

    pack: Callable  # (raw, type, rows, K) -> [codes, scales, offsets, super_scales]
    pack_into: Callable  # (raw, type, rows, K, [codes, scales, offsets, super_scales], first group)
    buffers: Callable  # (type, rows, K) -> the four buffers, unfilled
    join_target: Callable[[str, int], tuple[PackedWeight, int] | None] | None = None

    @classmethod
    def of(cls, kernels) -> NativeRepack:
        return cls(kernels.pack_gguf_blocks, kernels.pack_gguf_blocks_into, kernels.gguf_packed_buffers)

    def empty(self, qtype: int, rows: int, cols: int) -> PackedWeight:
        """An unfilled packed matrix of a block type (the fused buffers join_target hands out)."""
        return _packed_weight(rows, *self.buffers(qtype, rows, cols))


def _packed_weight(rows: int, codes, scales, offsets, super_scales) -> PackedWeight:
    bits = codes.shape[2] if codes.dtype == torch.uint8 else 8  # 4, 5 or 6 chunks a block: the width
    return PackedWeight(bits, rows, codes, scales, offsets, super_scales)


def packed_from_blocks(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    heads: int | None,
    repack: NativeRepack | None = None,
    name: str = "",
) -> PackedWeight:
    """The packed form of a block-type matrix `name` (data: the reader's (rows, bytes) view), its rows
    un-permuted for `heads` q/k heads when given. repack: the native kernels that pack the bytes in one pass;
    without them, tensor ops do (loader/dequant.py, runner/quantization.py), large matrices in slices of whole
    16-row groups, each written into the result as it is packed. A shard that repack.join_target places is
    packed into the fused matrix's buffers, and the whole (still filling) is returned."""
    rows, cols = shape
    if repack is not None:
        return _packed_natively(data, qtype, shape, heads, repack, name)
    step = max(GROUP, _PACK_CHUNK_WEIGHTS // cols // GROUP * GROUP)
    if heads is not None or rows <= step:  # un-permuting moves rows across the whole matrix
        codes = block_codes(data, qtype, shape)
        return pack_block_codes(
            codes if heads is None else codes.map_rows(lambda t: unpermute_rows(t, heads))
        )
    result: PackedWeight | None = None
    for start in range(0, rows, step):
        part = pack_block_codes(
            block_codes(data[start : start + step], qtype, (min(step, rows - start), cols))
        )
        if result is None:
            groups = -(-rows // GROUP)

            def empty_like(t: torch.Tensor, groups: int = groups) -> torch.Tensor:
                return t if t.numel() == 0 else t.new_empty((groups, *t.shape[1:]))

            result = PackedWeight(
                part.bits,
                rows,
                empty_like(part.codes),
                empty_like(part.scales),
                empty_like(part.offsets),
                empty_like(part.super_scales),
            )
        first = start // GROUP
        for whole, piece in (
            (result.codes, part.codes),
            (result.scales, part.scales),
            (result.offsets, part.offsets),
            (result.super_scales, part.super_scales),
        ):
            if piece.numel():
                whole[first : first + piece.shape[0]] = piece
    return result


def _packed_natively(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    heads: int | None,
    repack: NativeRepack,
    name: str,
) -> PackedWeight:
    """packed_from_blocks through the native kernels: one pass over the bytes."""
    rows, cols = shape
    if heads is not None:  # whole rows of blocks move: the same order unpermute_rows gives the values
        data = data[unpermute_rows(torch.arange(rows), heads).numpy()]
    with warnings.catch_warnings():  # a read-only view of the file mapping: the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).reshape(rows, -1))
    target = repack.join_target(name, cols) if repack.join_target is not None else None
    if target is not None:  # a shard of a fused matrix: packed straight into its rows of the whole
        joined, first_group = target
        buffers = [joined.codes, joined.scales, joined.offsets, joined.super_scales]
        repack.pack_into(raw, int(qtype), rows, cols, buffers, first_group)
        return joined
    return _packed_weight(rows, *repack.pack(raw, int(qtype), rows, cols))


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order, restoring Hugging Face's.

    Hugging Face's rotary embedding pairs dimension i of a head with i + head_dim/2 (two halves); ggml's
    pairs 2i with 2i + 1 (interleaved), so the converter reorders each head's rows from [half 0; half 1]
    to [r0 of half 0, r0 of half 1, r1 of half 0, ...]. Reading a head's rows as (head_dim/2, 2) and
    transposing to (2, head_dim/2) puts them back. Works for weights (rows, in) and biases (rows,).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # (num_heads, half, 2, ...) -> (num_heads, 2, half, ...)
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()
