"""Exact low-bit forms of weight matrices, packed for the native quantized matmul (kernels/quantized_linear.cpp).

Every GGUF block format serval packs (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) is a code q per
weight and, per row and block of 16 or 32 weights, a scale d and maybe an offset m: w = d q + m (with no offset,
a 4-, 5- or 6-bit code is biased: w = d (q - 8), d (q - 16), d (q - 32); MXFP4's 4-bit code indexes a table of
E2M1 values, w = MXFP4_VALUES[q] 2^(e - 128) for the block's exponent byte e). Codes keep their file's width:
4, 5, 6 or 8 bits, so a packed matrix takes what it takes in its file. The loader reads
codes and scales straight from a file's bytes (`BlockCodes`, loader/dequant.py) and `pack_block_codes` puts
them in the kernel's layout (kernels/quantized.h). Other checkpoints go through `find_packed`, which
recognizes a Q4_0/Q4_1/Q8_0-shaped matrix from its fp32 values, recovering its codes exactly (it checks the
round trip). loader/packer.py does this for each tensor of a checkpoint as it streams in. Nothing is
approximated: a matrix without an exact form gets None and stays on the bf16/fp32 path. GGUF F16/BF16
matrices have a 16-bit form (`sixteen_bit_form`): their own values, which the same kernel entry point widens
in registers, so the fp32 compute path never holds a 4-byte copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BLOCK = 32  # weights per block along the input dimension
GROUP = 16  # output rows per packed group (one 512-bit register of row sums)
SUPER_BLOCK = 256  # weights per k-quant super-block
_NONE = torch.empty(0)
# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4; its scale is halved to match): code q -> integer
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's exponent bytes (uint8) as ggml's GGML_E8M0_TO_FP32_HALF reads them: 2^(e - 128) in fp32
    exactly, built from its bits (e - 1 in the exponent field; e = 0, 1 the subnormals 2^-128, 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def is_e8m0(scales: torch.Tensor, super_scales: torch.Tensor | None) -> bool:
    """Whether a block matrix's scales are MXFP4's exponent bytes: uint8 scales without super-block scales
    (the k-quants' uint8 sub-block scales always come with theirs)."""
    return scales.dtype == torch.uint8 and (super_scales is None or not super_scales.numel())


@dataclass(frozen=True)
class BlockCodes:
    """A matrix's codes and scales as a GGUF file stores them (loader/dequant.py reads them from its bytes),
    one row per output feature, before packing: w = d q + m per row and scale block."""

    bits: int  # 4, 5, 6: codes uint8 0..2^bits - 1; 8: codes int8
    codes: torch.Tensor  # (N, K/32, 32)
    # (N, K/S): fp16 d, or with super_scales the 8-bit sub-block scales, or uint8 without them MXFP4's
    # exponent bytes e (4-bit codes: w = MXFP4_VALUES[q] 2^(e - 128))
    scales: torch.Tensor
    # (N, K/32): fp16 m, or with super_scales the uint8 mins; None: none (4-6 bits: w = d (q - 2^(bits-1)))
    offsets: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None  # (N, K/256, 2) fp16: D and -Dmin of each super-block

    def map_rows(self, f) -> BlockCodes:
        """The same with f applied to every tensor's rows (dim 0): f(t) -> t'."""
        return BlockCodes(
            self.bits,
            f(self.codes),
            f(self.scales),
            None if self.offsets is None else f(self.offsets),
            None if self.super_scales is None else f(self.super_scales),
        )


@dataclass
class PackedWeight:
    """A (out_features, in_features) matrix in one of the kernel's layouts (kernels/quantized.h): w = d q + m
    per row and scale block, d and m as the file stores them; or (bits 16) a GGUF F16/BF16 matrix's own
    values, which the kernel widens in registers (kernels/dense_linear.cpp)."""

    bits: int  # 4, 5, 6 or 8: the codes' width; 16: fp16/bf16 values, no scales
    out_features: int
    # 4-, 5-, 6-bit: (N/16, K/32, 4, 5 or 6, 64) uint8 (nibble chunks, then high bits; kernels/quantized.h);
    # 8-bit: (N/16, K/32, 8, 64) int8; 16-bit: (N, K) fp16 or bf16
    codes: torch.Tensor
    # (N/16, K/S, 16), S = 32 weights (Q6_K: 16): fp16 d, or with super_scales the 8-bit sub-block scales,
    # or uint8 without them MXFP4's exponent bytes (4-bit codes, no offsets)
    scales: torch.Tensor
    # (N/16, K/32, 16): fp16 m, or with super_scales the uint8 sub-block mins; empty: no offset (w = d q),
    # or for 4-bit codes m = -8 d (Q4_0)
    offsets: torch.Tensor = _NONE
    # (N/16, K/256, 2, 16) fp16: each super-block's D and -Dmin (k-quants: d = D sc, m = -Dmin mn); empty: none
    super_scales: torch.Tensor = _NONE

    def matmul(self, quantized_linear, x: torch.Tensor) -> torch.Tensor:  # x (M, K) -> (M, N), x's dtype
        """quantized_linear: the native kernel (kernels.quantized_linear)."""
        return quantized_linear(
            x, self.codes, self.scales, self.offsets, self.super_scales, self.out_features
        )

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets, self.super_scales)
        )

    @property
    def parts(self) -> list[PackedWeight]:
        return [self]

    def layout_key(self) -> tuple:
        """What must agree for two packed matrices to be stacked row-wise into one."""
        return (
            self.bits,
            self.codes.dtype,
            self.codes.shape[2:],
            self.scales.dtype,
            self.scales.shape[1:],
            self.offsets.shape[1:],
            self.super_scales.shape[1:],
        )

    def rows(self, indices: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, K) fp32
        """Rows of the matrix, dequantized exactly (an embedding lookup from the packed form)."""
        if self.bits == 16:
            return self.codes[indices].float()
        group, row = indices // GROUP, indices % GROUP
        taken = torch.arange(len(indices))
        codes = self.codes[group]  # (T, K/32, chunks, 64): byte (half h, row r, element e) of each chunk
        picked = codes.view(*codes.shape[:3], 2, GROUP, 2)[taken, :, :, :, row]  # (T, K/32, chunks, h, e)
        if self.bits == 8:  # (T, B, c, h, e) -> weight 4c + 2h + e
            q = picked.reshape(*picked.shape[:2], BLOCK)
        else:
            q = _codes_of_chunks(picked, self.bits)
            if not self.offsets.numel() and self.bits > 4:  # Q5_0, Q6_K: w = d (q - 2^(bits-1))
                q = q.to(torch.int16) - (1 << (self.bits - 1))
        mxfp4 = is_e8m0(self.scales, self.super_scales)
        if mxfp4:
            q = MXFP4_VALUES[q.long()]
        in_features = q.shape[1] * BLOCK
        scale_weights = in_features // self.scales.shape[1]
        scales = self.scales[group, :, row]
        d = e8m0_to_fp32_half(scales) if mxfp4 else scales.float()  # (T, K/S)
        m = self.offsets[group, :, row].float() if self.offsets.numel() else None  # (T, K/32)
        if m is None and self.bits == 4 and not mxfp4:  # Q4_0: w = d (q - 8)
            m = -8 * d
        if self.super_scales.numel():  # d = D sc, m = (-Dmin) mn, in fp32 as ggml forms them
            per_super = self.super_scales[group, :, :, row].float()  # (T, K/256, 2)
            d = per_super[:, :, 0].repeat_interleave(SUPER_BLOCK // scale_weights, dim=1) * d
            if m is not None:
                m = per_super[:, :, 1].repeat_interleave(SUPER_BLOCK // BLOCK, dim=1) * m
        w = q.float().reshape(len(indices), -1, scale_weights) * d.unsqueeze(-1)
        if m is not None:
            w = w.reshape(len(indices), -1, BLOCK) + m.unsqueeze(-1)
        return w.reshape(len(indices), -1)


@dataclass
class PackedParts:
    """A fused matrix whose shards are packed in different layouts (a Q4_K_M file's q and k in Q4_K, its v in
    Q6_K): each part runs its own matmul, and their outputs sit side by side. Every part but the last has
    whole groups of 16 rows, so a part's row count is its codes' (kernels/decode_stack.cpp relies on it)."""

    parts: list[PackedWeight]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, quantized_linear, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(quantized_linear, x) for p in self.parts], dim=-1)


def concatenated(parts: list[PackedWeight | None]) -> PackedWeight | PackedParts | None:
    """The packed form of a matrix fused from shards (in row order), or None if a shard has none."""
    if any(p is None for p in parts):
        return None
    # Only whole groups of 16 rows can be put end to end, or split between parts.
    if any(p.out_features % GROUP for p in parts[:-1]):
        return None
    runs: list[list[PackedWeight]] = []  # consecutive shards of one layout are stacked into one matrix
    for part in parts:
        if runs and runs[-1][0].layout_key() == part.layout_key():
            runs[-1].append(part)
        else:
            runs.append([part])
    stacked = [_stacked(run) for run in runs]
    return stacked[0] if len(stacked) == 1 else PackedParts(stacked)


def _stacked(parts: list[PackedWeight]) -> PackedWeight:
    """Packed matrices of one layout, the rows of each after the previous one's."""
    if len(parts) == 1:
        return parts[0]

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors) if tensors[0].numel() else tensors[0]

    return PackedWeight(
        bits=parts[0].bits,
        out_features=sum(p.out_features for p in parts),
        codes=torch.cat([p.codes for p in parts]),
        scales=cat([p.scales for p in parts]),
        offsets=cat([p.offsets for p in parts]),
        super_scales=cat([p.super_scales for p in parts]),
    )


def _scale_weights(bits: int) -> int:
    """Weights per scale of a packed layout with `bits`-bit codes: 16 for Q6_K's 6 bits, else 32."""
    return 16 if bits == 6 else BLOCK


def _codes_of_chunks(chunks: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., K/32, chunks, 2, 2) bytes (chunk c, half h, element e) of 4-, 5- or 6-bit codes -> (..., K/32, 32)
    uint8 codes: per scale block, nibble chunks then a chunk of high bits (kernels/quantized.h)."""
    high_bits, scale_weights = bits - 4, _scale_weights(bits)
    nibble_chunks = scale_weights // 8
    per_scale = chunks.reshape(*chunks.shape[:-3], BLOCK // scale_weights, -1, 2, 2)  # (..., S, c, h, e)
    nibbles = per_scale[..., :nibble_chunks, :, :]
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-3)  # (..., S, c, n, h, e): weight 8c + 4n + 2h + e
    if high_bits:
        high = per_scale[..., nibble_chunks, :, :].unsqueeze(-3).unsqueeze(-3)  # (..., S, 1, 1, h, e)
        at = high_bits * (2 * torch.arange(nibble_chunks).reshape(-1, 1) + torch.arange(2))  # (c, n)
        top = (high >> at.to(torch.uint8).reshape(nibble_chunks, 2, 1, 1)) & ((1 << high_bits) - 1)
        q = q | (top << 4)
    return q.reshape(*chunks.shape[:-3], BLOCK)


def pack_block_codes(block: BlockCodes) -> PackedWeight:
    """The packed form of a GGUF matrix's codes and scales as loader/dequant.py reads them from its bytes."""
    # Per group of 16 rows, block and chunk c, byte i = (half h, row r, element e) (kernels/quantized.h).
    rows = block.codes.shape[0]
    if block.bits == 8:  # weight 2(2c + h) + e
        pairs = block.codes.reshape(*block.codes.shape[:2], 8, 2, 2)
    else:  # per scale block: nibble n of chunk c is weight 8c + 4n + 2h + e; then the high bits
        high_bits, scale_weights = block.bits - 4, _scale_weights(block.bits)
        nibble_chunks = scale_weights // 8
        # (N, K/32, S, c, n, h, e)
        chunked = block.codes.reshape(*block.codes.shape[:2], BLOCK // scale_weights, nibble_chunks, 2, 2, 2)
        low = chunked & 0x0F
        pairs = low[..., 0, :, :] | (low[..., 1, :, :] << 4)  # (N, K/32, S, c, h, e)
        if high_bits:
            at = high_bits * (2 * torch.arange(nibble_chunks).reshape(-1, 1) + torch.arange(2))  # (c, n)
            shifted = (chunked >> 4).to(torch.int32) << at.reshape(nibble_chunks, 2, 1, 1)
            high = shifted.sum(dim=(-4, -3)).to(torch.uint8)  # (N, K/32, S, h, e): disjoint bits
            pairs = torch.cat([pairs, high.unsqueeze(-3)], dim=-3)
        pairs = pairs.reshape(*block.codes.shape[:2], -1, 2, 2)
    grouped = _grouped(pairs, rows)  # (N/16, K/32, 16 rows, c, h, e)
    codes = grouped.permute(0, 1, 3, 4, 2, 5).reshape(grouped.shape[0], grouped.shape[1], -1, 64)

    def per_group(t: torch.Tensor | None) -> torch.Tensor:
        return _NONE if t is None else _grouped(t, rows).contiguous()

    super_scales = _NONE
    if block.super_scales is not None:  # (N, K/256, 2) -> (N/16, K/256, 2, 16)
        super_scales = _grouped(block.super_scales, rows).permute(0, 1, 3, 2).contiguous()
    return PackedWeight(
        bits=block.bits,
        out_features=rows,
        codes=codes.contiguous(),
        scales=per_group(block.scales),
        offsets=per_group(block.offsets),
        super_scales=super_scales,
    )


def sixteen_bit_form(values: torch.Tensor) -> PackedWeight:
    """A (N, K) fp16 or bf16 matrix kept as it is, for the kernel that widens it in registers."""
    if values.dtype not in (torch.float16, torch.bfloat16) or values.dim() != 2:
        raise ValueError(
            f"a 16-bit form takes a (N, K) fp16 or bf16 matrix, not {values.dtype} {values.shape}"
        )
    return PackedWeight(16, values.shape[0], values.contiguous(), _NONE)


def dense_placeholder(weight: torch.Tensor, device: torch.device | str | None = None) -> nn.Parameter:
    """A stand-in for a dense weight whose packed form is used instead: the matrix's shape and dtype (which
    the native DecodeStack reads) over a single element; nothing computes with it."""
    device = weight.device if device is None else device
    placeholder = torch.zeros((), dtype=weight.dtype, device=device).expand(weight.shape)
    return nn.Parameter(placeholder, requires_grad=False)


def is_placeholder(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (0, 0)


def find_packed(weight: torch.Tensor) -> PackedWeight | None:
    """The exact 4-bit (preferred) or 8-bit packed form of a 2-D fp32 weight, or None if it has neither."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK != 0 or weight.dtype != torch.float32:
        return None
    # In slices of rows (whole groups): the checks' fp32 temporaries of a 49,152-row embedding would
    # otherwise add hundreds of MB to the load's peak memory.
    step = 128 * GROUP
    parts = [_find_packed_rows(weight[start : start + step]) for start in range(0, weight.shape[0], step)]
    packed = concatenated(parts)
    return packed if isinstance(packed, PackedWeight) else None  # one layout for the whole matrix


def _find_packed_rows(weight: torch.Tensor) -> PackedWeight | None:
    blocks = weight.reshape(weight.shape[0], -1, BLOCK)  # (N, K/32, 32)
    # Q4_0's form first: its offset is implied (m = -8 d), so it packs smaller than the same values as Q4_1.
    found = _exact_four_bit_symmetric(blocks)
    if found is not None:
        codes, scale, _ = found
        return pack_block_codes(BlockCodes(4, codes, scale))
    found = _exact_four_bit(blocks)
    if found is not None:
        codes, scale, low = found
        return pack_block_codes(BlockCodes(4, codes, scale, low.half()))
    found = _exact_eight_bit(blocks)
    if found is not None:
        return pack_block_codes(BlockCodes(8, *found))
    return None


def _exact_four_bit(blocks: torch.Tensor):
    # Q4_1 stores m = min and d = (max - min) / 15, so both are read back from each block's extremes.
    low = blocks.amin(-1)
    if not (low.half().float() == low).all():
        return None
    return _four_bit_codes(blocks, ((blocks.amax(-1) - low) / 15).half(), low)


def _exact_four_bit_symmetric(blocks: torch.Tensor):
    # Q4_0: w = d (q - 8) with d = -v / 8 for the block's value v of largest magnitude (which gets q = 0):
    # the form d q + m with m = -8 d.
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = (largest / -8).half()
    low = -8 * scale.float()  # exact: a power of two times an fp16 (the kernels form it the same way)
    return _four_bit_codes(blocks, scale, low)


def _four_bit_codes(blocks: torch.Tensor, scale: torch.Tensor, low: torch.Tensor):
    """(codes, scale, low) if every block is exactly scale * q + low with q in 0..15, else None."""
    if not torch.isfinite(scale).all():
        return None
    d = scale.float().unsqueeze(-1)
    codes = torch.where(d != 0, (blocks - low.unsqueeze(-1)) / torch.where(d != 0, d, 1), 0).round()
    if codes.min() < 0 or codes.max() > 15:
        return None
    if not _round_trips(codes * d + low.unsqueeze(-1), blocks):
        return None
    return codes.to(torch.uint8), scale, low


def _exact_eight_bit(blocks: torch.Tensor):
    scale = (blocks.abs().amax(-1) / 127).half()
    if not torch.isfinite(scale).all():
        return None
    d = scale.float().unsqueeze(-1)
    codes = torch.where(d > 0, blocks / d.clamp(min=1e-30), 0).round()
    if codes.abs().max() > 127 or not _round_trips(codes * d, blocks):
        return None
    return codes.to(torch.int8), scale


def _round_trips(rebuilt: torch.Tensor, blocks: torch.Tensor) -> bool:
    # The dequantizer's own fp32 arithmetic may round its last bit differently from ours.
    return bool(((rebuilt - blocks).abs() <= 1e-6 * blocks.abs() + 1e-12).all())


def _grouped(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Pad the rows (dim 0) to whole groups of 16 and move each group's rows innermost-but-one."""
    padded_rows = -(-num_rows // GROUP) * GROUP
    if padded_rows != num_rows:
        t = torch.cat([t, t.new_zeros((padded_rows - num_rows, *t.shape[1:]))])
    return t.reshape(padded_rows // GROUP, GROUP, *t.shape[1:]).transpose(1, 2)  # (N/16, K/32, 16, ...)
