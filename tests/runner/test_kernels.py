"""Native CPU kernels against PyTorch on the same inputs (the attention kernel is in test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.runner.kernels import load_cpu_kernels
from serval.runner.layers import GatedMLP, RMSNorm, use_native_kernels
from tests.fixtures.kernels import has_compiler


def test_kernels_build_wherever_there_is_a_compiler():
    # The fallback to PyTorch is for machines without a C++ toolchain; a source that stops compiling must
    # fail here rather than turn every kernel test into a skip.
    if not has_compiler():
        pytest.skip("no C++ compiler on this machine")
    assert load_cpu_kernels() is not None


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(96, 64), (576, 1536), (1000, 576)])
def test_bf16_small_batch_linear_matches_fp32_reference(kernels, rows, shape):
    torch.manual_seed(rows)
    out_features, in_features = shape
    x = torch.randn(rows, in_features).bfloat16()
    w = torch.randn(out_features, in_features).bfloat16()
    reference = x.float() @ w.float().t()  # exact products of the bf16 values, fp32 sums
    got = kernels.bf16_linear_small_batch(x, w).float()
    # Only the final rounding to bf16 (8 bits of mantissa) and the summation order differ.
    assert ((got - reference).abs() / (reference.abs() + 1.0)).max().item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_match_pytorch(kernels, dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(7, 3, 64) * 50  # fp32 residual-stream-like input, 3D as for per-head q/k norms
    expected = norm(x)
    norm.native_kernel = kernels.rms_norm
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.float() - expected.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.05)

    mlp = GatedMLP(64, 96).to(dtype)
    h = torch.randn(5, 64).to(dtype)
    expected = mlp(h)
    mlp.silu_mul_kernel = kernels.silu_mul
    assert (mlp(h).float() - expected.float()).abs().max().item() < (1e-5 if dtype == torch.float32 else 0.05)


def test_a_row_is_normed_alike_alone_and_among_others(kernels):
    """The norm's rows are split over the threads and each row's sum of squares goes in vector lanes: a
    row's bits must not depend on how many rows share the call (batch invariance)."""
    torch.manual_seed(1)
    x = torch.randn(70, 576) * 20
    weight = torch.randn(576).bfloat16()
    together = kernels.rms_norm(x, weight, 1e-5)
    alone = torch.cat([kernels.rms_norm(x[r : r + 1], weight, 1e-5) for r in range(len(x))])
    assert torch.equal(together.view(torch.int16), alone.view(torch.int16))


@pytest.mark.parametrize("shape", [(64, 49152), (3, 7), (5, 33)])
def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities(kernels, shape):
    torch.manual_seed(shape[1])
    x = torch.randn(*shape)
    x[0, 3] = x[0, 5] = x[0].max() + 1  # equal maxima: the first
    x[1, 4] = x[1, 2] = float("nan")  # a NaN counts as the largest: the first NaN
    x[2].fill_(-float("inf"))
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))


def test_bf16_model_logits_agree_with_and_without_the_kernels(tiny_model_factory, kernels, monkeypatch):
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    directory, _ = tiny_model_factory("qwen2", False)
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="bfloat16"), cache=CacheConfig(num_blocks=32)
    )
    runner = Engine(config).runner
    decode_step = Batch([17], [1], [0], [[0]], [0], [])
    logits = {}
    for use_kernel in (True, False):
        use_native_kernels(runner.model, kernels if use_kernel else None)
        if not use_kernel:
            runner.model.decode_stack = None
        logits[use_kernel] = runner.compute_logits(decode_step)[0]
    assert (logits[True] - logits[False]).abs().max().item() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_matches_pytorch_on_strided_views(kernels, dtype):
    from serval.runner.layers import RotaryEmbedding, rope_inverse_frequencies

    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 256, rope_inverse_frequencies(32, 10000.0, None))
    positions = torch.tensor([0, 5, 77, 200, 201])
    qkv = torch.randn(5, (4 + 2 + 2) * 32).to(dtype)  # q, k, v side by side, as the fused projection gives
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.view(5, 4, 32), k.view(5, 2, 32)
    expected_q, expected_k = rotary.tables(positions, dtype).apply(q.clone(), k.clone())
    rotary.native_kernel = kernels.rotary_embedding_
    got_q, got_k = rotary.tables(positions, dtype).apply(q, k)  # in place on the views
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert (got_q.float() - expected_q.float()).abs().max().item() < tolerance
    assert (got_k.float() - expected_k.float()).abs().max().item() < tolerance
    assert got_q.data_ptr() == q.data_ptr()  # rotated where it lies, no copy


def test_lone_decode_steps_run_on_the_configured_threads(tiny_model_factory, monkeypatch):
    directory, _ = tiny_model_factory("llama", False)
    config = EngineConfig(
        model=ModelConfig(model=directory, single_sequence_threads=1), cache=CacheConfig(num_blocks=32)
    )
    runner = Engine(config).runner
    seen = []
    compute = runner.compute_logits
    monkeypatch.setattr(
        runner, "compute_logits", lambda batch: (seen.append(torch.get_num_threads()), compute(batch))[1]
    )
    runner.execute(Batch([3, 4, 5], [3], [0], [[0]], [], []))  # a prefill: every thread
    runner.execute(Batch([6], [1], [3], [[0]], [], []))  # a lone decode: one
    runner.execute(Batch([6, 7], [1, 1], [3, 0], [[0], [1]], [], []))  # two sequences: every thread
    assert seen == [runner.num_threads, 1, runner.num_threads]
