"""Exact low-bit packing of GGUF blocks and the native quantized matmul, against references in PyTorch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.runner.kernels import quantized_matmul
from serval.runner.loader.dequant import BLOCK_CODE_TYPES, block_codes, dequantize
from serval.runner.quantization import (
    BLOCK,
    BlockCodes,
    find_packed,
    is_e8m0,
    pack_block_codes,
    sixteen_bit_form,
)
from tests.fixtures.gguf_writer import write_gguf_from_state_dict
from tests.fixtures.kernels import require_kernels
from tests.fixtures.quants import random_blocks

BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
REPO_ROOT = Path(__file__).resolve().parents[2]
# Every block type, in the order of GGML's enum.
BLOCK_TYPES = sorted(BLOCK_CODE_TYPES)


def _gguf_matrix(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A random matrix as a GGUF file stores it in `qtype`, dequantized by gguf's own reference code."""
    rng = np.random.default_rng(seed)
    array = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    array[0, :5] = [3.0, -2.5, 0.0, 1e-4, -1e-4]  # an outlier block, and tiny values
    blocks = gguf.quants.quantize(array, qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32)).reshape(rows, cols)


def _unpack(packed) -> torch.Tensor:
    """The dense weights a packed form stands for, decoded independently of the packing code."""
    groups, num_blocks = packed.codes.shape[:2]
    d = packed.scales.float()  # (G, B, 16)
    raw = (
        packed.codes.view(torch.uint8).reshape(groups, num_blocks, -1, 2, 16, 2).long()
    )  # (G, B, c, h, r, e)
    if packed.bits == 4:
        low, high = raw & 0xF, raw >> 4
        # chunk c, half h, element e: low nibble = weight 2(4c + h) + e, high = weight 2(4c + 2 + h) + e
        q = torch.stack([low, high], dim=3)  # (G, B, c, nibble, h, r, e)
        q = q.permute(0, 5, 1, 2, 3, 4, 6).reshape(groups, 16, num_blocks, BLOCK).float()
        m = packed.offsets.float() if packed.offsets.numel() else -8 * d  # Q4_0: w = d (q - 8)
        w = q * d.permute(0, 2, 1)[..., None] + m.permute(0, 2, 1)[..., None]
    else:
        q = torch.where(raw > 127, raw - 256, raw)  # int8
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(groups, 16, num_blocks, BLOCK).float()
        w = q * d.permute(0, 2, 1)[..., None]
    return w.reshape(groups * 16, num_blocks * BLOCK)[: packed.out_features]


@pytest.mark.parametrize("qtype", list(BITS), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [40, 2100])  # a padded last group; several slices of 2048 rows
def test_gguf_blocks_are_recovered_exactly(qtype, rows):
    weight = _gguf_matrix(qtype, rows, 96, seed=1)
    packed = find_packed(weight)
    assert packed is not None and packed.bits == BITS[qtype]
    assert torch.equal(_unpack(packed), weight)


@pytest.mark.parametrize("qtype", list(BITS), ids=lambda t: t.name)
def test_rows_of_the_packed_form_are_the_matrix_rows(qtype):
    # An embedding look-up from the packed codes: the exact fp32 rows, in any order, repeated, from the
    # padded last group too.
    weight = _gguf_matrix(qtype, 40, 96, seed=3)
    packed = find_packed(weight)
    indices = torch.tensor([0, 39, 17, 16, 15, 17, 33])
    assert torch.equal(packed.rows(indices), weight[indices])


@pytest.mark.parametrize("qtype", list(BITS), ids=lambda t: t.name)
def test_packing_from_the_file_bytes_equals_recognizing_the_dequantized_values(qtype):
    rng = np.random.default_rng(5)
    array = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(array, qtype)
    from_bytes = pack_block_codes(block_codes(raw, qtype, (40, 96)))
    recognized = find_packed(torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)))
    assert from_bytes.bits == recognized.bits == BITS[qtype]
    for field in ("codes", "scales", "offsets", "super_scales"):
        assert torch.equal(getattr(from_bytes, field), getattr(recognized, field)), field


def _file_matrix(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int):
    """(the matrix's GGUF bytes, its weights as dequantize decodes them: gguf's reference, bit for bit)."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return raw, dequantize(raw, qtype, (rows, cols))


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q6_K], ids=lambda t: t.name
)
def test_large_matrices_are_packed_in_slices_to_the_same_form(qtype, monkeypatch):
    from serval.runner.loader import gguf_pack

    raw, _ = _file_matrix(qtype, 40, 512, seed=2)
    whole = pack_block_codes(block_codes(raw, qtype, (40, 512)))
    monkeypatch.setattr(gguf_pack, "_PACK_CHUNK_WEIGHTS", 16 * 512)  # slices of 16, 16 and 8 rows
    sliced = gguf_pack.packed_from_blocks(raw, qtype, (40, 512), heads=None)
    for field in ("codes", "scales", "offsets", "super_scales"):
        assert torch.equal(getattr(sliced, field), getattr(whole, field)), field
    assert sliced.out_features == 40


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("heads", [None, 4])  # plain, and q/k rows un-permuted for 4 heads
def test_native_packing_of_file_bytes_equals_the_tensor_ops(kernels, qtype, heads):
    from serval.runner.loader import gguf_pack

    raw, _ = _file_matrix(qtype, 40, 512, seed=5)
    reference = gguf_pack.packed_from_blocks(raw, qtype, (40, 512), heads)
    native = gguf_pack.packed_from_blocks(raw, qtype, (40, 512), heads, gguf_pack.NativeRepack.of(kernels))
    assert (native.bits, native.out_features) == (reference.bits, reference.out_features)
    for field in ("codes", "scales", "offsets", "super_scales"):
        got, expected = getattr(native, field), getattr(reference, field)
        assert got.dtype == expected.dtype and torch.equal(got, expected), field


def _offsets(block: BlockCodes) -> torch.Tensor:
    """m of every (row, block of 32) as fp32, zero for formats without one."""
    rows, num_blocks = block.codes.shape[:2]
    if block.offsets is None:  # 4-bit codes without offsets are Q4_0's (m = -8 d) but for MXFP4's (none)
        four_bit_symmetric = block.bits == 4 and not is_e8m0(block.scales, block.super_scales)
        return -8 * block.scales.float() if four_bit_symmetric else torch.zeros(rows, num_blocks)
    if block.super_scales is None:
        return block.offsets.float()
    return block.super_scales[..., 1].float().repeat_interleave(8, dim=1) * block.offsets.float()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_packed_forms_from_the_file_bytes_are_the_file_weights_exactly(qtype):
    # Each format's codes and scales, read from its bytes and packed, give back gguf's own dequantization
    # bit for bit (rows: the embedding look-up's decode), padded last group included.
    raw, weight = _file_matrix(qtype, 40, 512, seed=11)
    packed = pack_block_codes(block_codes(raw, qtype, (40, 512)))
    assert torch.equal(packed.rows(torch.arange(40)), weight)
    indices = torch.tensor([39, 0, 17, 17, 16])
    assert torch.equal(packed.rows(indices), weight[indices])
    # Codes at their file's width (4, 5, 6 or 8 bits): about the file's size, scales laid out per row.
    file_bytes = raw.nbytes * 48 / 40  # the packed form pads 40 rows to 48
    assert packed.nbytes <= 1.03 * file_bytes


def test_weights_without_an_exact_form_are_left_alone():
    torch.manual_seed(0)
    assert find_packed(torch.randn(32, 64)) is None
    assert find_packed(torch.randn(32, 64).bfloat16().float()) is None  # bf16 values are not 4/8-bit blocks
    assert find_packed(torch.randn(32, 48)) is None  # width not a multiple of 32


OUTLIER_RATIO = 10.0  # int8_split.h's kOutlierRatio


def _reference(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, levels: int = 32767
) -> torch.Tensor:
    """What the integer kernels compute: x rounded per block of 32 to int16 (levels 32767: the few-row
    path) or int8 (127: --batch-activations int8 where the build has it for the layout) times d q, plus
    m * sum(x_b) of the same rounded x (offsets: m per row and block of 32): the file's weights times the rounded x. The int8 path keeps outliers (values past 10x their row's
    RMS) exact and rounds the rest of their blocks without them."""
    m, k = x.shape
    x = x.float()
    outliers = torch.zeros(m, k, dtype=torch.bool)
    if levels == 127:
        outliers = x.square() > OUTLIER_RATIO**2 * x.square().mean(-1, keepdim=True)
    xb = torch.where(outliers, 0.0, x).reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = (torch.where(amax > 0, torch.round(xb * (levels / amax)), 0) * (amax / levels)).reshape(m, k)
    xq = torch.where(outliers, x, xq)
    wb = weight.reshape(weight.shape[0], -1, BLOCK)
    scaled = (wb - offsets[..., None]).reshape(weight.shape)  # d * q
    return (
        xq.double() @ scaled.double().t() + xq.double().reshape(m, -1, BLOCK).sum(-1) @ offsets.double().t()
    )


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16, 17, 64])
def test_quantized_matmul_matches_reference(kernels, qtype, rows):
    # K = 768: 3 super-blocks of the k-quants; K 352 for the 32-weight formats (11 blocks: not a multiple
    # of any pass over K).
    cols = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 352
    raw, weight = _file_matrix(qtype, 72, cols, seed=rows)
    block = block_codes(raw, qtype, (72, cols))
    packed = pack_block_codes(block)
    torch.manual_seed(rows)
    x = torch.randn(rows, cols) * 4
    x[0, 3] = 900.0  # outliers: two in one column, one in another column of the same block
    x[-1, 3] = 500.0
    x[-1, 17] = -700.0
    got = packed.matmul(kernels.quantized_linear, x)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    exact = x.double() @ weight.double().t()
    # Integer dot products at every row count: x rounded to int16 per block (2^-15 of each block's largest
    # value).
    expected = _reference(x, weight, _offsets(block)).float()
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()
    assert ((got.double() - exact).abs() / (exact.abs().max() + 1)).max().item() < 5e-3
    if rows >= kernels.int8_rows_from:  # int8 x where the build has it (portable: 0, never)
        int8 = packed.matmul(quantized_matmul(kernels, int8_batch_activations=True), x)
        # int8 x over 4-bit codes wherever AVX2 is, over Q8_0's int8 codes with AVX-512-VNNI, and over the
        # 5-bit layouts' and Q6_K's codes on AVX2 without AVX-512.
        avx512 = kernels.variant.startswith("avx512")
        int8_codes = (
            packed.bits == 4 or (packed.bits == 8 and avx512) or (packed.bits in (5, 6) and not avx512)
        )
        if int8_codes and kernels.int8_rows_from:
            # x rounded to 1/127 of each block's largest value, the outlier channel (900) exact.
            expected = _reference(x, weight, _offsets(block), levels=127).float()
            assert (int8 - expected).abs().max().item() < 1e-4 * expected.abs().max().item()
            error = (int8.double() - exact).abs() / (exact.abs().max() + 1)
            assert error.max().item() < 5e-2
        else:  # no int8 path for this layout or build: what the kernel computes without it
            assert torch.equal(int8, got)
    # bf16 x (a bf16 model): the products are of the exact weights, within bf16's rounding of the result.
    xb = x.bfloat16()
    got_bf16 = packed.matmul(kernels.quantized_linear, xb)
    assert got_bf16.shape == (rows, 72) and got_bf16.dtype == torch.bfloat16
    magnitude = xb.double().abs() @ weight.double().abs().t()
    exact_bf16_x = xb.double() @ weight.double().t()
    assert ((got_bf16.double() - exact_bf16_x).abs() <= 2**-7 * magnitude + 1e-6).all()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("int8", [False, True], ids=["int16_x", "int8_x"])
@pytest.mark.parametrize("wide", [False, True], ids=["short_rows", "long_rows"])
def test_each_row_is_computed_alike_whatever_the_row_count(kernels, qtype, int8, wide):
    """Batch invariance at the matmul: a row's output is bitwise the same alone and among any number of
    other rows (a decode alone, in a batch of 64, in a prefill chunk), for fp32 and bf16 x, outliers included.
    Long rows of weights (over 1536) take other many-row passes on AVX2 (quantized_linear.cpp's kTileMaxK)."""
    super_blocks = gguf.GGML_QUANT_SIZES[qtype][0] == 256
    cols = (1792 if super_blocks else 1568) if wide else (768 if super_blocks else 352)
    raw, _ = _file_matrix(qtype, 40, cols, seed=3)
    packed = pack_block_codes(block_codes(raw, qtype, (40, cols)))
    kernel = quantized_matmul(kernels, int8_batch_activations=int8)
    torch.manual_seed(3)
    x = torch.randn(70, cols) * 3
    x[6, 5] = 800.0  # an outlier, kept exact by the int8 path: per row, too
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        alone = torch.cat([packed.matmul(kernel, rows[r : r + 1]) for r in range(len(rows))])
        for count in (2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 70):
            assert torch.equal(packed.matmul(kernel, rows[:count]), alone[:count]), (dtype, count)


TILE_TYPES = [t for t in BLOCK_TYPES if t.name in ("Q4_0", "Q4_1", "Q4_K", "MXFP4", "Q8_0")]


def amx_case_results(kernels) -> list[torch.Tensor]:
    """The int8 path's results for the layouts AMX tiles take: 37 rows of x (2 whole tiles and 5 rows for the
    passes), fp32 and bf16, outliers in tiled and untiled rows, K past several spans of 8 scale blocks."""
    kernel = quantized_matmul(kernels, int8_batch_activations=True)
    results = []
    for qtype in TILE_TYPES:
        cols = 1792 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 1568
        raw, _ = _file_matrix(qtype, 40, cols, seed=5)
        packed = pack_block_codes(block_codes(raw, qtype, (40, cols)))
        x = torch.randn(37, cols, generator=torch.Generator().manual_seed(5)) * 3
        x[4, 9], x[35, 100] = 700.0, -650.0
        results += [packed.matmul(kernel, x), packed.matmul(kernel, x.bfloat16())]
    return results


def test_amx_tiles_give_the_bits_of_the_vpdpbusd_passes(tmp_path):
    """Where the int8 path takes whole tiles of 16 rows through AMX (int8_rows_amx.h: Sapphire Rapids and
    later), each row's result is bitwise what the VPDPBUSD passes give it: the same matmuls in a process with
    AMX turned off (SERVAL_DISABLE_AMX=1; the choice is made once a process). (The row-count test above
    compares tiled batches with lone rows, which the passes compute, on such a CPU too.)"""
    kernels = require_kernels("avx512")
    if kernels.int8_tile_rows() == 0:
        pytest.skip("this CPU or kernel does not let the process use AMX-INT8")
    assert kernels.int8_tile_rows() == 16
    with_tiles = amx_case_results(kernels)
    out = tmp_path / "passes.pt"
    script = (
        "import sys, torch; from serval.runner.kernels import load_cpu_kernels;"
        " from tests.runner.test_quantized import amx_case_results; k = load_cpu_kernels('avx512');"
        " assert k.int8_tile_rows() == 0; torch.save(amx_case_results(k), sys.argv[1])"
    )
    env = {**os.environ, "SERVAL_DISABLE_AMX": "1"}
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=REPO_ROOT, timeout=600)
    without_tiles = torch.load(out)
    assert len(with_tiles) == len(without_tiles) == 2 * len(TILE_TYPES)
    for qtype, tiled, passes in zip([t for t in TILE_TYPES for _ in (0, 1)], with_tiles, without_tiles):
        assert torch.equal(tiled, passes), qtype.name


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_a_bf16_result_is_the_fp32_result_rounded_as_torch_rounds(kernels, qtype):
    """bf16 x gives a bf16 result, which the int8 path writes group by group as each completes (not through
    a second pass): it must be torch's rounding of what fp32 x of the same values gives, bit for bit, in the
    padded last group too (N = 40: 2.5 groups), for large, tiny, infinite and NaN results alike."""
    cols = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 352
    raw, _ = _file_matrix(qtype, 40, cols, seed=5)
    packed = pack_block_codes(block_codes(raw, qtype, (40, cols)))
    torch.manual_seed(5)
    x = (torch.randn(19, cols) * 3).bfloat16()
    x[2] *= 1e-30  # results near the bottom of bf16's range
    x[3, 7] = 3e38  # infinite results
    x[4, 9] = float("nan")
    for int8 in (False, True):
        kernel = quantized_matmul(kernels, int8_batch_activations=int8)
        got = packed.matmul(kernel, x)
        want = packed.matmul(kernel, x.float()).bfloat16()
        same_bits = got.view(torch.int16) == want.view(torch.int16)
        assert got.dtype == torch.bfloat16 and (same_bits | got.isnan() & want.isnan()).all(), int8  # any NaN


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_a_result_added_into_the_residual_stream_is_torchs_sum(kernels, qtype):
    """quantized_linear_add_ (a decoder layer's x += o(attn) and x += down(act)) adds the result into the fp32
    residual group by group on the int8 path, with no result tensor: it must be residual.add_(quantized_linear())
    bit for bit, for bf16 x (the bf16 result's values added) and fp32 x, with and without int8 x, outliers and
    the padded last group (N = 40) included; and the fallbacks must agree too."""
    cols = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 352
    raw, _ = _file_matrix(qtype, 40, cols, seed=7)
    packed = pack_block_codes(block_codes(raw, qtype, (40, cols)))
    tensors = (packed.codes, packed.scales, packed.offsets, packed.super_scales, packed.out_features)
    torch.manual_seed(7)
    for rows in (1, 19, 64):
        x = torch.randn(rows, cols) * 3
        x[rows // 2, 5] = 800.0  # an outlier
        residual = torch.randn(rows, 40) * 10
        for dtype in (torch.bfloat16, torch.float32):
            for int8 in (False, True):
                want = residual.clone().add_(kernels.quantized_linear(x.to(dtype), *tensors, int8))
                got = residual.clone()
                kernels.quantized_linear_add_(got, x.to(dtype), *tensors, int8)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, dtype, int8)
    with pytest.raises(RuntimeError, match="residual"):
        kernels.quantized_linear_add_(torch.zeros(3, 41), torch.randn(3, cols), *tensors, True)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_a_fused_swiglu_is_silu_mul_of_the_gate_up_result(kernels, qtype):
    """quantized_swiglu (a decoder layer's silu(gate) * up straight from the gate_up matmul, group pairs on the
    int8 path) must be silu_mul(quantized_linear()) bit for bit, for bf16 and fp32 x, with and without int8 x,
    outliers included; an intermediate size of whole groups (32) fuses, one of 1.5 groups (24) falls back."""
    cols = 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 352
    torch.manual_seed(9)
    for inter, rows in ((32, 1), (32, 64), (24, 19)):
        raw, _ = _file_matrix(qtype, 2 * inter, cols, seed=9)
        packed = pack_block_codes(block_codes(raw, qtype, (2 * inter, cols)))
        tensors = (packed.codes, packed.scales, packed.offsets, packed.super_scales, packed.out_features)
        x = torch.randn(rows, cols) * 3
        x[rows // 2, 5] = 800.0  # an outlier
        for dtype in (torch.bfloat16, torch.float32):
            for int8 in (False, True):
                want = kernels.silu_mul(kernels.quantized_linear(x.to(dtype), *tensors, int8))
                got = kernels.quantized_swiglu(x.to(dtype), *tensors, int8)
                assert got.dtype == want.dtype and torch.equal(got, want), (inter, dtype, int8)


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    ],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize("rows", [4, 32])
def test_rounded_x_meets_the_file_weights_not_their_codes(kernels, qtype, rows):
    """The integer paths round x per block; their error must be that rounding times the file's weights
    (d q + m, centred on 0), no more. Paired with the exact sum of x in the offset term, the rounding met d q
    alone (q 0..15: all one sign), which measured 1.5-3x this error per matmul and 3x llama.cpp's divergence
    from fp32 on the default model."""
    raw, weight = _file_matrix(qtype, 256, 1024, seed=rows)
    packed = pack_block_codes(block_codes(raw, qtype, (256, 1024)))
    torch.manual_seed(rows)
    x = torch.randn(rows, 1024)  # no outliers: the rounding is the same as the Python model's below
    exact = x.double() @ weight.double().t()
    for levels, kernel in ((32767, kernels.quantized_linear), (127, quantized_matmul(kernels, True))):
        if levels == 127 and not (kernels.int8_rows_from and rows >= kernels.int8_rows_from):
            continue  # int8 x wherever the build has it (int8_rows_from: 1 with AVX2, 0 in the portable build)
        blocks = x.reshape(rows, -1, BLOCK)
        step = blocks.abs().amax(-1, keepdim=True) / levels
        rounded = (torch.round(blocks / step) * step).reshape(rows, -1)
        floor = (rounded.double() @ weight.double().t() - exact).norm()
        error = (packed.matmul(kernel, x).double() - exact).norm()
        assert error <= 1.02 * floor + 1e-6 * exact.norm(), (levels, float(error / floor))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["F16", "BF16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64])
def test_sixteen_bit_matmul_is_the_fp32_matmul_of_the_stored_values(kernels, dtype, rows):
    # 200 output rows: more than one decode chunk; K 352: not a multiple of 64, so vector tails are taken.
    torch.manual_seed(rows)
    weight = (torch.randn(200, 352) * 0.05).to(dtype)
    packed = sixteen_bit_form(weight)
    x = torch.randn(rows, 352) * 4
    x[0, 3] = 900.0
    got = packed.matmul(kernels.quantized_linear, x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    exact = x.double() @ weight.double().t()
    assert (got.double() - exact).abs().max().item() < 1e-5 * exact.abs().max().item()
    assert torch.equal(packed.rows(torch.tensor([0, 199, 7])), weight[[0, 199, 7]].float())
    xb = x.bfloat16()
    got_bf16 = packed.matmul(kernels.quantized_linear, xb)
    assert got_bf16.dtype == torch.bfloat16
    # bf16 x past 8 rows: oneDNN's bf16 matmul over the weights as bf16 (F16 ones rounded a panel at a time).
    magnitude = xb.double().abs() @ weight.double().abs().t()
    dense_bf16 = xb.double() @ weight.bfloat16().double().t()
    assert ((got_bf16.double() - dense_bf16).abs() <= 2**-7 * magnitude + 1e-6).all()


def test_quantized_matmul_refuses_inconsistent_packed_tensors(kernels):
    raw, _ = _file_matrix(GGMLQuantizationType.Q4_K, 32, 256, seed=0)
    packed = pack_block_codes(block_codes(raw, GGMLQuantizationType.Q4_K, (32, 256)))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="super-block"):
        kernels.quantized_linear(
            x, packed.codes, packed.scales, packed.offsets, packed.super_scales[:, :, :1], 32
        )
    with pytest.raises(RuntimeError, match="codes vs x"):
        kernels.quantized_linear(torch.randn(1, 512), packed.codes, packed.scales, packed.offsets,
                                 packed.super_scales, 32)  # fmt: skip


def _decode_logits_both_ways(engine: Engine, prompts: list[list[int]]):
    """One decode step over the prompts' sequences, once through the native DecodeStack and once through
    the Python layers, from the same cache state: (stack logits, python logits)."""
    runner = engine.runner
    block_size = runner.block_size
    tables, next_block = [], 0
    for prompt in prompts:
        count = -(-(len(prompt) + 1) // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    prefill = Batch(
        [t for p in prompts for t in p], [len(p) for p in prompts], [0] * len(prompts), tables, [], []
    )
    runner.compute_logits(prefill)
    decode = Batch([5] * len(prompts), [1] * len(prompts), [len(p) for p in prompts], tables,
                   list(range(len(prompts))), [])  # fmt: skip
    assert runner.model.decode_stack is not None
    stacked = runner.compute_logits(decode)
    stack, runner.model.decode_stack = runner.model.decode_stack, None
    try:
        layered = runner.compute_logits(decode)  # rewrites the same K/V slots with the same values
    finally:
        runner.model.decode_stack = stack
    return stacked, layered


PROMPTS = [list(range(3, 40)), [7, 99, 250, 13, 13, 13, 5], list(range(300, 340, 2))]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm
def test_decode_stack_computes_what_the_layers_compute(
    tiny_model_factory, kernels, architecture, monkeypatch
):
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    directory, _ = tiny_model_factory(architecture, False)
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(
            model=ModelConfig(model=directory, dtype=dtype), cache=CacheConfig(num_blocks=32)
        )
        stacked, layered = _decode_logits_both_ways(Engine(config), PROMPTS)
        assert torch.equal(stacked, layered), dtype


def test_decode_stack_with_packed_gguf_weights(tiny_model_factory, kernels, tmp_path, monkeypatch):
    # Q4_1 matrices and a tied Q8_0-style head are packed on the bf16 path; the stack and the layers agree,
    # and both stay close to the fp32 engine on the same file (which never uses the packed forms).
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    _, reference = tiny_model_factory("llama", True)
    path = str(tmp_path / "q4_1.gguf")
    write_gguf_from_state_dict(
        path, reference.config.to_dict(), reference.state_dict(), qtype_for_matrices=GGMLQuantizationType.Q4_1
    )
    bf16 = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="bfloat16"), cache=CacheConfig(num_blocks=32))
    )
    model = bf16.runner.model
    assert bf16.runner.info.kernel_variant == kernels.variant
    assert model.layers[0].mlp.gate_up_proj.quantized_kernel is not None
    assert model.packed_tied_head is not None and model.packed_tied_head.bits == 4
    # Every batch size runs from the codes (bf16 tiles past 8 rows): no dense bf16 copy is kept beside them.
    assert model.layers[0].mlp.gate_up_proj.weight.stride() == (0, 0)
    assert model.embed_tokens.weight.stride() == (0, 0)
    stacked, layered = _decode_logits_both_ways(bf16, PROMPTS)
    assert torch.equal(stacked, layered)
    fp32 = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(num_blocks=32))
    )
    assert fp32.runner.model.layers[0].mlp.gate_up_proj.quantized_kernel is None
    exact, _ = _decode_logits_both_ways(fp32, PROMPTS)
    assert (stacked - exact).abs().max().item() < 0.05 * exact.abs().max().item()


def test_auto_dtype_without_native_bf16_runs_the_file_packed_in_fp32(
    tiny_model_factory, kernels, tmp_path, monkeypatch
):
    # A CPU without bf16 dot products (AVX2): `auto` computes in fp32 from the packed codes and frees the
    # dense copies (the kernels serve every batch size there), instead of an fp32 model 7x the file's size.
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    monkeypatch.setattr("serval.runner.placement.cpu_has_native_bf16", lambda: False)
    _, reference = tiny_model_factory("llama", True)
    path = str(tmp_path / "q4_1.gguf")
    write_gguf_from_state_dict(
        path, reference.config.to_dict(), reference.state_dict(), qtype_for_matrices=GGMLQuantizationType.Q4_1
    )
    dequantized: set[GGMLQuantizationType] = set()

    def spy(data, qtype, shape):
        dequantized.add(GGMLQuantizationType(qtype))
        return dequantize(data, qtype, shape)

    monkeypatch.setattr("serval.runner.loader.gguf.dequantize", spy)
    # The exact paths (int16 x for decode, fp32 tiles for prefill): int8 batches are tested in
    # test_weight_formats.py::test_int8_batch_activations_stay_near_the_exact_path.
    auto = Engine(
        EngineConfig(
            model=ModelConfig(model=path, batch_activations="float32"), cache=CacheConfig(num_blocks=32)
        )
    )
    info = auto.runner.info
    assert info.dtype == "float32" and info.packed_weights and info.kernel_variant == kernels.variant
    model = auto.runner.model
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.packed is not None and gate_up.weight.stride() == (0, 0)  # the dense copy was freed
    # The tied embedding too: look-ups read its packed rows, the head its packed matmul.
    assert model.embed_tokens.weight.stride() == (0, 0)
    assert model.packed_embedding is model.packed_tied_head is not None
    # None of the file's blocks was ever dequantized to fp32: the reader packed them from their bytes and
    # yielded only their shapes.
    assert dequantized and not dequantized & BLOCK_CODE_TYPES
    exact = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(num_blocks=32))
    )
    assert not exact.runner.info.packed_weights
    packed_logits, layered = _decode_logits_both_ways(auto, PROMPTS)
    assert torch.equal(packed_logits, layered)
    exact_logits, _ = _decode_logits_both_ways(exact, PROMPTS)
    # Only the int16 rounding of the decode's activations differs from the exact fp32 matmuls.
    assert (packed_logits - exact_logits).abs().max().item() < 1e-3 * exact_logits.abs().max().item()
