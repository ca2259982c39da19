"""Random k-quant blocks (Q4_K, Q6_K) for bench/make_model.py's `--type Q4_K_M`.

gguf-py cannot quantize to these types (its Q4_K and Q6_K have no quantize_blocks), and llama-quantize takes
about an hour per 10B weights on 2 cores. A random-weight file needs no quantizer: its codes are random
anyway, so the blocks are written directly, random codes under scales chosen so that the dequantized
weights have about the wanted standard deviation and mean zero. The kernels read, unpack and multiply
them exactly as they would a quantized checkpoint's (speed and memory are real; the values are noise).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
RANDOM_BLOCK_TYPES = (Q.Q4_K, Q.Q6_K)

# Q4_K (ggml's block_q4_K, 144 bytes a 256 weights): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
# eight 6-bit mins, 128 bytes of 4-bit codes; a weight is d * scale * q - dmin * min. Uniform q (mean 7.5, var
# 21.25) and scales and mins uniform in 0..63 (mean 31.5, var 341.25): dmin = 7.5 d centres the weights on
# zero, and their variance is d^2 (Var(scale q) + 7.5^2 Var(min)) = d^2 (47532 + 19195).
_Q4_K_CODE_STD = (47532.0 + 19195.0) ** 0.5
# Q6_K (block_q6_K, 210 bytes a 256 weights): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8
# scales, fp16 d; a weight is d * scale * (q - 32), q uniform in 0..63 (E[(q - 32)^2] = 341.5) and the scales
# uniform in 1..63 (E[scale^2] = 1354.7).
_Q6_K_CODE_STD = (1354.7 * 341.5) ** 0.5


def random_blocks(num_rows: int, num_cols: int, qtype: GGMLQuantizationType, std: float, rng) -> np.ndarray:
    """(num_rows, row bytes) uint8: random `qtype` blocks whose weights have about `std`."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * (num_cols // block_size)
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    if qtype == Q.Q4_K:
        d = np.float16(std / _Q4_K_CODE_STD)
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), dtype=np.uint8)
    elif qtype == Q.Q6_K:
        blocks[:, 192:208] = rng.integers(1, 64, size=(num_blocks, 16), dtype=np.uint8)  # int8 scales
        blocks[:, 208:210] = np.frombuffer(np.float16(std / _Q6_K_CODE_STD).tobytes(), dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(num_rows, -1)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in a Q4_K_M file
    (src/llama-quant.cpp): the first and last eighth, and every third layer between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2
