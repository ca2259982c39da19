"""The bytes of a tensor in each GGML block type, for bench/make_model.py: values quantized (gguf's quantizer,
and a faster one of the same bytes for MXFP4), or random k-quant blocks (Q4_K, Q5_K, Q6_K) for `--type
Q4_K_M` and `Q5_K_M`.

gguf-py cannot quantize to the k-quants (its Q4_K and Q6_K have no quantize_blocks); the tests' round-to-nearest
quantizer can (tests/fixtures/quants.py, bench/batch_matmul.py uses it), at ~58M values/s for Q4_K here, which
with the random floats puts a 30B file at ~13 minutes, and llama-quantize takes about an hour per 10B weights
on 2 cores. A random-weight file needs no quantizer: its codes are random anyway, so the blocks are written
directly (the 30B file in ~1.5 minutes), random codes under scales chosen so that the dequantized weights
have about the wanted standard deviation and mean zero. The kernels read, unpack and multiply
them exactly as they would a quantized checkpoint's (speed and memory are real; the values are noise).
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
RANDOM_BLOCK_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

# Q4_K (ggml's block_q4_K, 144 bytes a 256 weights): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
# eight 6-bit mins, 128 bytes of 4-bit codes; a weight is d * scale * q - dmin * min. Uniform q (mean 7.5, var
# 21.25) and scales and mins uniform in 0..63 (mean 31.5, var 341.25): dmin = 7.5 d centres the weights on
# zero, and their variance is d^2 (Var(scale q) + 7.5^2 Var(min)) = d^2 (47532 + 19195).
_Q4_K_CODE_STD = (47532.0 + 19195.0) ** 0.5
# Q5_K (block_q5_K, 176 bytes a 256 weights): Q4_K's d, dmin and scales, then 32 bytes of high bits and 128 of
# low nibbles: q uniform in 0..31 (mean 15.5, var 85.25), so dmin = 15.5 d centres the weights, and their
# variance is d^2 (Var(scale q) + 15.5^2 Var(min)) = d^2 (195666 + 81985).
_Q5_K_CODE_STD = (195666.0 + 81985.0) ** 0.5
# Q6_K (block_q6_K, 210 bytes a 256 weights): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8
# scales, fp16 d; a weight is d * scale * (q - 32), q uniform in 0..63 (E[(q - 32)^2] = 341.5) and the scales
# uniform in 1..63 (E[scale^2] = 1354.7).
_Q6_K_CODE_STD = (1354.7 * 341.5) ** 0.5


def random_blocks(num_rows: int, num_cols: int, qtype: GGMLQuantizationType, std: float, rng) -> np.ndarray:
    """(num_rows, row bytes) uint8: random `qtype` blocks whose weights have about `std`."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * (num_cols // block_size)
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):
        code_std, code_mean = (_Q4_K_CODE_STD, 7.5) if qtype == Q.Q4_K else (_Q5_K_CODE_STD, 15.5)
        d = np.float16(std / code_std)
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(code_mean * float(d)).tobytes(), dtype=np.uint8)
    elif qtype == Q.Q6_K:
        blocks[:, 192:208] = rng.integers(1, 64, size=(num_blocks, 16), dtype=np.uint8)  # int8 scales
        blocks[:, 208:210] = np.frombuffer(np.float16(std / _Q6_K_CODE_STD).tobytes(), dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(num_rows, -1)


# The MXFP4 (e2m1) magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 times twice the block scale; these are the
# midpoints between neighbours in those doubled units. A value exactly on a midpoint takes the lower index,
# as the first minimum of gguf's argmin does.
_MXFP4_MIDPOINTS = tuple(np.float32(t) for t in (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0))


def quantize_mxfp4(values: np.ndarray) -> np.ndarray:
    """The same bytes as gguf.quants.quantize(values, MXFP4), about 8x faster and with a 16x smaller peak.

    gguf's quantizer measures every value's distance to all 16 codes ((n, 32, 16) float32 temporaries);
    the block scale 2^(floor(log2 absmax) - 3) is a power of two, so dividing by it is exact and the nearest
    magnitude is a count of midpoints below. Per 32-value block: one E8M0 scale byte, then 16 bytes whose
    low nibbles hold values 0-15 and high nibbles values 16-31 (code = magnitude index | sign << 3).
    """
    blocks = values.reshape(-1, 32)
    magnitude = np.abs(blocks)
    absmax = magnitude.max(axis=1)
    with np.errstate(divide="ignore"):
        exponent = np.where(absmax > 0, np.floor(np.log2(absmax)) - 2 + 127, 0).astype(np.uint8)
    # ggml_e8m0_to_fp32_half; clamped at the smallest normal float, which only a block whose absmax is
    # under 2^-124 (never a N(0, 0.02) block) would reach. An all-zero block's codes stay 0.
    scale = np.maximum(gguf.quants.MXFP4.e8m0_to_fp32_half(exponent), np.float32(2.0**-126))
    magnitude *= np.where(absmax > 0, np.float32(1.0) / scale, np.float32(0.0))[:, None]
    codes = np.zeros(blocks.shape, dtype=np.uint8)
    for midpoint in _MXFP4_MIDPOINTS:
        codes += magnitude > midpoint
    codes |= ((blocks < 0) & (codes > 0)).view(np.uint8) << np.uint8(3)  # a zero keeps code 0, never -0
    packed = codes[:, :16] | (codes[:, 16:] << np.uint8(4))
    encoded = np.concatenate([exponent[:, None], packed], axis=1)  # (blocks, 17)
    return encoded.reshape(*values.shape[:-1], values.shape[-1] // 32 * 17)


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, cols) float32 -> (rows, row bytes) uint8."""
    if qtype == Q.MXFP4:
        return quantize_mxfp4(values)
    # quantize returns float32/float16 for F32/F16 and uint8 blocks otherwise; all are the row's bytes
    return gguf.quants.quantize(values, qtype).view(np.uint8)
