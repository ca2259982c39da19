"""Our torch dequantizers against the `gguf` package's numpy reference, type by type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from serval.runner.loader.dequant import SUPPORTED_TYPES, UnsupportedQuantizationError, dequantize

# Byte offsets of the fp16 scale fields in the block layouts the gguf package cannot quantize to: random
# bytes there would often be NaN or inf, which compare badly and mean nothing.
FP16_OFFSETS = {
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
SHAPE = (6, 1024)  # rows x columns; 1024 is a multiple of every block size


def _random_data(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """The tensor's GGUF data, shaped as GGUFReader gives it: typed for floats, (rows, bytes) for quants."""
    weights = rng.standard_normal(SHAPE).astype(np.float32)
    if qtype not in FP16_OFFSETS:
        return quants.quantize(weights, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = SHAPE[0] * SHAPE[1] // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in FP16_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(SHAPE[0], -1)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: GGMLQuantizationType) -> None:
    data = _random_data(qtype, np.random.default_rng(int(qtype)))
    expected = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype)))

    got = dequantize(data, qtype, SHAPE)

    assert got.dtype == torch.float32 and got.shape == SHAPE
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected.reshape(SHAPE), rtol=0, atol=0)


def test_mxfp4_decodes_every_exponent_and_code_exactly() -> None:
    # Every E8M0 byte whose weights are all finite (from 253 on 12 x 2^(e - 128) overflows fp32), the
    # subnormal scales of e = 0 and 1 included, against every nibble in both halves of the block: a product
    # of a small integer and a power of two, bit for bit.
    qtype = GGMLQuantizationType.MXFP4
    exponents = np.repeat(np.arange(253, dtype=np.uint8), 2)  # (506,): each byte twice, the codes differ
    codes = np.random.default_rng(1).integers(0, 256, size=(exponents.size, 16), dtype=np.uint8)
    codes[0] = codes[2] = np.arange(16, dtype=np.uint8) * 0x11  # every code, low and high nibble
    blocks = np.concatenate([exponents[:, None], codes], axis=1).reshape(2, -1)  # (rows, bytes)
    expected = torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks, qtype))).reshape(2, -1)
    got = dequantize(blocks, qtype, tuple(expected.shape))
    assert torch.isfinite(expected).all() and (expected[0, :32] != 0).any()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16])
def test_dequantize_accepts_raw_bytes_and_any_shape(qtype: GGMLQuantizationType) -> None:
    # the same bytes, flat uint8 and reshaped to 3-D torch order, decode to the same values
    data = _random_data(qtype, np.random.default_rng(0))
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    got = dequantize(flat, qtype, (2, 3, 1024))

    torch.testing.assert_close(got.reshape(SHAPE), dequantize(data, qtype, SHAPE), rtol=0, atol=0)


def test_dequantize_result_is_writable_and_owned() -> None:
    data = quants.quantize(np.ones(SHAPE, dtype=np.float32), GGMLQuantizationType.F32)
    data.flags.writeable = False  # like the reader's views of a mapped file

    got = dequantize(data, GGMLQuantizationType.F32, SHAPE)
    got.add_(1)

    assert float(data[0, 0]) == 1.0


def test_unsupported_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="IQ2_XXS") as info:
        dequantize(np.zeros(66, dtype=np.uint8), GGMLQuantizationType.IQ2_XXS, (256,))
    assert isinstance(info.value, ValueError)
    for qtype in SUPPORTED_TYPES:
        assert qtype.name in str(info.value)


def test_wrong_byte_count_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(np.zeros(30, dtype=np.uint8), GGMLQuantizationType.Q8_0, (32,))
