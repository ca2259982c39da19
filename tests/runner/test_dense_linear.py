"""kernels.dense_linear, the dense matmul of every unpacked weight: a row's output is bitwise the same whatever
the number of rows beside it (batch invariance, docs/architecture.md), and close to PyTorch's fp32 matmul of
the same values, on every kernel variant this CPU runs.

K covers a whole number of vector steps (64), a zero-padded tail (100, 2100) and several passes over K (2100,
4160: dense_linear.cpp's kDepth is 2048); the row counts a lone row, partial row tiles, more than one block of
64 rows (130).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serval.runner.layers import Linear, use_native_kernels

# (x dtype, weight dtype): fp32 models, bf16 models, and GGUF F16 matrices kept as stored in either compute
ACCUMULATIONS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
]
# The result is rounded to x's dtype: bf16 keeps 8 bits of mantissa.
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _ids(pair) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in pair)


@pytest.mark.parametrize("dtypes", ACCUMULATIONS, ids=_ids)
@pytest.mark.parametrize("in_features", [64, 100, 2100, 4160])
def test_a_row_has_the_same_bits_at_every_row_count(kernels, dtypes, in_features):
    x_dtype, w_dtype = dtypes
    torch.manual_seed(in_features)
    w = torch.randn(37, in_features).to(w_dtype)
    x = torch.randn(130, in_features).to(x_dtype)
    full = kernels.dense_linear(x, w)
    assert full.dtype == x_dtype and full.shape == (130, 37)
    for row in (0, 1, 63, 64, 129):
        assert torch.equal(kernels.dense_linear(x[row : row + 1], w)[0], full[row]), row
    for start, stop in ((0, 2), (3, 8), (5, 22), (60, 70), (1, 130)):
        assert torch.equal(kernels.dense_linear(x[start:stop], w), full[start:stop]), (start, stop)
    reference = x.float() @ w.float().t()  # exact products of the same values, fp32 sums
    error = ((full.float() - reference).abs() / (reference.abs() + 1.0)).max().item()
    assert error < RELATIVE_TOLERANCE[x_dtype] * (in_features**0.5 if x_dtype == torch.float32 else 1.0)


def test_16_bit_gguf_matrices_take_the_same_path(kernels):
    # quantized_linear's 16-bit layout (a GGUF F16/BF16 matrix kept as stored) is dense_linear's.
    torch.manual_seed(0)
    w = torch.randn(48, 256).half()
    x = torch.randn(20, 256)
    none = torch.empty(0)
    got = kernels.quantized_linear(x, w, none, none, none, 48)
    assert torch.equal(got, kernels.dense_linear(x, w))
    assert torch.equal(kernels.quantized_linear(x[7:8], w, none, none, none, 48)[0], got[7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_layers_use_it_at_every_row_count(kernels, dtype):
    layer = Linear(96, 40, bias=True).to(dtype)
    use_native_kernels(layer, kernels)
    # bf16 weights take it only when asked (--deterministic): oneDNN's bf16 GEMM is faster at 64 rows
    assert layer.dense_kernel is (kernels.dense_linear if dtype == torch.float32 else None)
    use_native_kernels(layer, kernels, deterministic=True)
    assert layer.dense_kernel is kernels.dense_linear
    x = torch.randn(33, 96).to(dtype)
    with torch.no_grad():
        batch = layer(x)
        alone = [layer(x[i : i + 1])[0] for i in range(33)]
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert all(torch.equal(a, b) for a, b in zip(alone, batch))
    assert (batch.float() - expected).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("dtypes", ACCUMULATIONS[:2], ids=_ids)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_the_heads_form_is_each_heads_dense_linear(kernels, dtypes, rows):
    # MLA's absorbed products (runner/mla.py): every head's rows exactly dense_linear's on that head alone,
    # from a strided x (a (tokens, heads, K) tensor seen head-major), at any row count.
    x_dtype, w_dtype = dtypes
    torch.manual_seed(rows)
    heads, in_features, out_features = 3, 100, 40
    w = torch.randn(heads, out_features, in_features).to(w_dtype)
    x = torch.randn(rows, heads, in_features).to(x_dtype).transpose(0, 1)  # (heads, rows, K), not contiguous
    out = kernels.dense_linear_heads(x, w)
    assert out.dtype == x_dtype and out.shape == (heads, rows, out_features)
    for head in range(heads):
        assert torch.equal(out[head], kernels.dense_linear(x[head], w[head])), head
    assert torch.equal(kernels.dense_linear_heads(x[:, :1], w), out[:, :1])
    with pytest.raises(RuntimeError, match="heads"):
        kernels.dense_linear_heads(x, w[:2])
