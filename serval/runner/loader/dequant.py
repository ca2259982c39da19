"""GGUF tensor data to float32 torch tensors.

Owns the byte layouts of the ggml types serval can load (plain floats, the 32-element legacy quants, the
256-element k-quants and MXFP4) and nothing else: which tensor means what, and renaming, live in `gguf.py`.

Every decoder works on all blocks at once: the raw bytes become a `(num_blocks, type_size)` uint8 tensor,
each field of the block is a column slice of it, and the weights come out as `(num_blocks, block_size)`.
The arithmetic follows ggml's reference dequantizers op for op (in float32), so the results equal theirs
bit for bit, which the tests check against the `gguf` package.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from serval.runner.quantization import MXFP4_VALUES, BlockCodes, e8m0_to_fp32_half

QK_K = 256  # elements in a k-quant super-block
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K


class UnsupportedQuantizationError(ValueError):
    """A tensor is stored in a ggml type that has no decoder here."""


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # (num_blocks, 1): the little-endian fp16 at byte `start` of each block, as float32
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # (num_blocks, 2 * n): low nibbles of the n bytes first, then high nibbles, the order every
    # 4-bit ggml format stores elements in
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    # (num_blocks, 8 * n): bit i of the little-endian bit string `packed`, i.e. bit (i % 8) of byte i // 8
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | qs (32 x int8); x = d * q
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | qs (16 bytes, 32 nibbles); x = d * (q - 8)
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | m (f16) | qs (16 bytes); x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return d * q + m


def _q5_codes(blocks: torch.Tensor, high_at: int) -> torch.Tensor:
    # (num_blocks, 32) uint8 0..31: 32 high bits at byte high_at, then 16 bytes of low nibbles
    return _nibbles(blocks[:, high_at + 4 :]) | (_bits(blocks[:, high_at : high_at + 4]) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | qh (32 high bits) | qs (16 bytes of low nibbles); x = d * (q - 16)
    return _f16(blocks, 0) * (_q5_codes(blocks, 2).to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | m (f16) | qh (32 high bits) | qs (16 bytes); x = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _q5_codes(blocks, 4).float() + m


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The 12 bytes hold 8 six-bit scales and 8 six-bit mins. Bytes 0-3 carry scales 0-3 in their low 6
    # bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from the nibbles of bytes 8-11 and
    # their top 2 bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    # Byte-major (12, num_blocks): element-wise ops over rows of 4 bytes run ~10x slower than over long rows.
    by_byte = packed.t().contiguous()
    lo_sc, lo_m, hi = by_byte[0:4], by_byte[4:8], by_byte[8:12]
    scales = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)])
    mins = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)])
    return scales.t().contiguous(), mins.t().contiguous()  # (num_blocks, 8) uint8 each


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    # (num_blocks, 8, 32): the 128 bytes are 4 chunks of 32; chunk c's low nibbles are sub-block 2c,
    # its high nibbles sub-block 2c + 1
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _k_codes(blocks: torch.Tensor, five_bit: bool) -> torch.Tensor:
    # (num_blocks, 8, 32) uint8 codes of Q4_K (block: d | dmin | scales (12) | qs (128)) or Q5_K (block: d |
    # dmin | scales (12) | qh (32) | qs (128), the fifth bit of element l of sub-block j is bit j of qh[l])
    if not five_bit:
        return _k_low_nibbles(blocks[:, 16:])
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (blocks[:, 16:48].unsqueeze(1) >> shifts) & 1  # (num_blocks, 8, 32)
    return _k_low_nibbles(blocks[:, 48:]) | (high << 4)


def _k_quant(blocks: torch.Tensor, five_bit: bool) -> torch.Tensor:
    # Q4_K / Q5_K sub-block j: x = d*sc_j*q - dmin*m_j
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    dl = (d * scales.float()).unsqueeze(-1)  # (num_blocks, 8, 1)
    ml = (dmin * mins.float()).unsqueeze(-1)
    return (dl * _k_codes(blocks, five_bit).float() - ml).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, five_bit=False)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, five_bit=True)


def _q6_codes(blocks: torch.Tensor) -> torch.Tensor:
    # (num_blocks, 256) uint8 codes q (0..63; the weight is d sc (q - 32)) of Q6_K (block: ql (128) | qh (64) | scales (16 x int8) | d (f16)).
    # Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]: its low nibbles are elements 0-63,
    # high nibbles 64-127, and the 2-bit pairs of qh (bits 0-1, 2-3, 4-5, 6-7) top elements 0-31, 32-63, ...
    ql = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 2, 128)
    return (low | (high << 4)).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # x = d * sc_g * (q - 32), one int8 scale sc_g per 16 elements
    d = _f16(blocks, 208)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    q = (_q6_codes(blocks).float() - 32).reshape(-1, 16, 16)
    return ((d * scales).unsqueeze(-1) * q).reshape(-1, QK_K)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block: e (E8M0 exponent byte) | qs (16 bytes, 32 E2M1 nibbles as Q4_0's); x = kvalues[q] * 2^(e - 128),
    # exact in fp32 (a small integer times a power of two)
    d = e8m0_to_fp32_half(blocks[:, :1])
    return MXFP4_VALUES[_nibbles(blocks[:, 1:]).long()].float() * d


BlockDecoder = Callable[[torch.Tensor], torch.Tensor]

_BLOCK_DECODERS: MappingProxyType[GGMLQuantizationType, BlockDecoder] = MappingProxyType(
    {
        GGMLQuantizationType.Q8_0: _q8_0,
        GGMLQuantizationType.Q4_0: _q4_0,
        GGMLQuantizationType.Q4_1: _q4_1,
        GGMLQuantizationType.Q5_0: _q5_0,
        GGMLQuantizationType.Q5_1: _q5_1,
        GGMLQuantizationType.Q4_K: _q4_k,
        GGMLQuantizationType.Q5_K: _q5_k,
        GGMLQuantizationType.Q6_K: _q6_k,
        GGMLQuantizationType.MXFP4: _mxfp4,
    }
)
_FLOAT_DTYPES: MappingProxyType[GGMLQuantizationType, torch.dtype] = MappingProxyType(
    {
        GGMLQuantizationType.F32: torch.float32,
        GGMLQuantizationType.F16: torch.float16,
        GGMLQuantizationType.BF16: torch.bfloat16,
    }
)
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (*_FLOAT_DTYPES, *_BLOCK_DECODERS)


def is_supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _FLOAT_DTYPES or qtype in _BLOCK_DECODERS


# Types whose blocks are codes with a scale (and offset) per 16 or 32 weights: the quantized kernels'
# packed forms (runner/quantization.py). MXFP4's scale is an exponent byte, its code an index into a table.
BLOCK_CODE_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.MXFP4,
    }
)


def block_codes(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> BlockCodes:
    """The codes and scales of a BLOCK_CODE_TYPES matrix straight from its bytes, no float decode, such that
    w = d * q + m is exactly what `dequantize` gives (runner/quantization.py's BlockCodes says the shapes)."""
    qtype = GGMLQuantizationType(qtype)
    rows, cols = shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy()).reshape(
        -1, type_size
    )
    per_row = (rows, -1)

    def f16(start: int) -> torch.Tensor:
        return blocks[:, start : start + 2].contiguous().view(torch.float16).reshape(per_row)

    def codes(q: torch.Tensor) -> torch.Tensor:
        return q.reshape(rows, cols // 32, 32)

    Q = GGMLQuantizationType
    if qtype == Q.Q8_0:
        return BlockCodes(8, codes(blocks[:, 2:].contiguous().view(torch.int8)), f16(0))
    if qtype == Q.Q4_0:  # w = d (q - 8): the kernels form the offset -8 d themselves
        return BlockCodes(4, codes(_nibbles(blocks[:, 2:])), f16(0))
    if qtype == Q.Q4_1:
        return BlockCodes(4, codes(_nibbles(blocks[:, 4:])), f16(0), f16(2))
    if qtype == Q.Q5_0:  # w = d (q - 16): no offsets, so the kernels subtract the bias 16
        return BlockCodes(5, codes(_q5_codes(blocks, 2)), f16(0))
    if qtype == Q.Q5_1:
        return BlockCodes(5, codes(_q5_codes(blocks, 4)), f16(0), f16(2))
    if qtype in (Q.Q4_K, Q.Q5_K):  # d = D sc, m = -Dmin mn
        scales, mins = _k_scales_mins(blocks[:, 4:16])
        five_bit = qtype == Q.Q5_K
        q = _k_codes(blocks, five_bit)
        super_scales = torch.stack([f16(0), -f16(2)], dim=-1)  # (rows, K/256, 2)
        return BlockCodes(
            5 if five_bit else 4,
            codes(q),
            scales.reshape(per_row),
            mins.reshape(per_row),
            super_scales,
        )
    if qtype == Q.Q6_K:  # d = D sc per 16 weights, w = d (q - 32)
        d = f16(208)
        super_scales = torch.stack([d, torch.zeros_like(d)], dim=-1)
        scales = blocks[:, 192:208].contiguous().view(torch.int8).reshape(per_row)
        return BlockCodes(6, codes(_q6_codes(blocks)), scales, None, super_scales)
    if qtype == Q.MXFP4:  # w = MXFP4_VALUES[q] 2^(e - 128): the raw nibbles and the exponent bytes
        return BlockCodes(4, codes(_nibbles(blocks[:, 1:])), blocks[:, 0].reshape(per_row))
    raise UnsupportedQuantizationError(f"{qtype.name} has no packed form")


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor's GGUF data to a float32 tensor of `shape` (torch order: GGUF's ne reversed).

    `data` is the tensor's bytes, either raw uint8 or the typed view `GGUFReader` gives float tensors.
    The result owns its memory (never a view of a memory-mapped file).
    """
    qtype = GGMLQuantizationType(qtype)
    if not is_supported(qtype):
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedQuantizationError(
            f"GGUF tensor type {qtype.name} is not supported; supported types: {names}"
        )
    num_elements = int(np.prod(shape, dtype=np.int64))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if num_elements % block_size != 0:
        raise ValueError(f"{qtype.name} tensor of shape {shape} is not a whole number of {block_size}-blocks")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    num_bytes = num_elements // block_size * type_size
    if raw.size != num_bytes:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {num_bytes} bytes, got {raw.size}")
    # NOTE: a copy, because the reader's arrays are read-only views of the mapped file and torch wants
    # writable memory; it is the size of the packed data, small next to the float32 result.
    blocks = torch.from_numpy(raw.copy())
    if qtype in _FLOAT_DTYPES:
        return blocks.view(_FLOAT_DTYPES[qtype]).float().reshape(shape)
    blocks = blocks.reshape(-1, type_size)  # (num_blocks, type_size)
    return _BLOCK_DECODERS[qtype](blocks).reshape(shape)
