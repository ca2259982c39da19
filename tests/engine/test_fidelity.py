"""The default model's answers, as `serve` computes them, against dense fp32: teacher-forced over the same
tokens, so a flipped near-tie counts for what it is (bench/fidelity.py measures the same at length).

The bounds sit between what the paths measure and what a defect measured: int8 batches (the default past 8
rows) 0.0013-0.0020 nats a token at 32 tokens on this model, llama-server 0.0028 on the same file, and the
offset-term defect of 2026-12-03 0.008-0.009; the exact paths 0.0007 (bf16 compute) and 0 (fp32). Decode
steps of one row: int16 x with VNNI 0.0003 (fp32 compute), int8 x on AVX2 0.0013.
"""

from __future__ import annotations

import pytest

from serval import LLM, SamplingParams
from serval.runner.kernels import runnable_variants
from tests.fixtures.fidelity import divergence, fp32_reference, teacher_forced_log_probs
from tests.fixtures.prompts import PROMPTS


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, fp32's greedy answers, fp32's teacher-forced log-probabilities) over all 16 prompts: a
    prefill of 16 prompts and decode steps of 16 rows, both past the 8 rows where int8 batches begin."""
    return fp32_reference(None, PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))


@pytest.mark.parametrize(("batch_activations", "bound"), [("int8", 0.004), ("float32", 0.0015)])
def test_the_served_paths_stay_near_fp32(reference, batch_activations, bound):
    prompts, answers, expected = reference
    llm = LLM(dtype="auto", batch_activations=batch_activations)
    assert llm.engine.runner.has_packed_weights
    measured = divergence(expected, teacher_forced_log_probs(llm, prompts, answers))
    assert measured["positions"] == 16 * 16
    assert measured["kl_mean"] < bound, measured
    assert measured["top_token_agreement"] >= 0.95, measured


@pytest.mark.parametrize(
    "variant", [v.name for v in runnable_variants() if v.name != "portable"] or ["portable"]
)
def test_single_stream_decode_stays_near_fp32(reference, variant, monkeypatch):
    """Decode steps of one row, as a lone stream decodes, on every integer kernel this CPU runs: int16 x with
    VNNI (exact to 2^-15), int8 x on AVX2 (VPMADDUBSW: its int16 products bound a batch-1 decode there)."""
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", variant)
    prompts, answers, expected = reference
    llm = LLM(dtype="auto")
    assert llm.engine.runner.info.kernel_variant == variant
    measured = divergence(expected, teacher_forced_log_probs(llm, prompts, answers, rows_per_step=1))
    assert measured["positions"] == 16 * 16
    assert measured["kl_mean"] < 0.004, measured
    assert measured["top_token_agreement"] >= 0.95, measured
