"""Batch invariance on the default model with the default flags: a greedy request's tokens and logprobs are
bitwise the same alone and beside any other work (batches of 2..64 of other prompts, chunked prefill forced
small, a prefix-cache hit, preemption), on every kernel variant this CPU runs (docs/architecture.md).

Each variant runs in both compute dtypes the default picks: bf16 (a CPU with native bf16 products) and fp32
(one without: the packed weights computed in fp32). On a CPU without native bf16 the default is fp32 already,
so the fp32 setup would repeat it and skips. The portable build leaves the many-row and preemption cases to
the SIMD variants (_skip_many_rows_on_portable). The best variant in this CPU's default dtype runs in the
quick suite, the rest under `slow`.
"""

from __future__ import annotations

import pytest

from serval import LLM, SamplingParams
from serval.runner import placement
from serval.runner.kernels import runnable_variants
from tests.fixtures.kernels import VARIANT_NAMES, require_kernels
from tests.fixtures.prompts import PROMPTS

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
PROBES = [PROMPTS[0], PROMPTS[6], PROMPTS[11], "Write one sentence about the sea. " * 9]


def _answers(outputs) -> list[tuple]:
    """Each request's token ids and every logprob it reported (the chosen token's and its top 2), as floats."""
    answers = []
    for output in outputs:
        choice = output.outputs[0]
        answers.append((choice.token_ids, [(lp.logprob, lp.top) for lp in choice.logprobs]))
    return answers


def _setups() -> list:
    best = runnable_variants()[0].name if runnable_variants() else None
    setups = []
    for variant in VARIANT_NAMES:
        for compute in ("default", "fp32"):
            marks = () if (variant, compute) == (best, "default") else (pytest.mark.slow,)
            setups.append(pytest.param((variant, compute), id=f"{variant}-{compute}", marks=marks))
    return setups


@pytest.fixture(scope="module", params=_setups())
def setup(request):
    """LLM instances made inside it run on the variant, in fp32 compute where asked."""
    variant, compute = request.param
    if compute == "fp32" and not placement.cpu_has_native_bf16():
        pytest.skip("this CPU has no native bf16: its default compute is fp32, the default setup's run")
    require_kernels(variant)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_KERNEL_VARIANT", variant)
        if compute == "fp32":
            patch.setattr(placement, "cpu_has_native_bf16", lambda: False)
        yield variant


@pytest.fixture(scope="module")
def alone(setup) -> list[tuple]:
    llm = LLM(max_num_seqs=64)
    assert llm.engine.runner.info.kernel_variant == setup
    return [_answers(llm.generate(prompt, PARAMS))[0] for prompt in PROBES]


def _fillers(count: int) -> list[str]:
    """Other prompts of other lengths, longer and shorter than the probes."""
    return [(PROMPTS[(i + 3) % len(PROMPTS)] + " ") * (1 + i % 5) for i in range(count)]


def _skip_many_rows_on_portable(variant: str) -> None:
    # The portable build computes every row count in the same passes of 8 rows, which each probe's prefill
    # (alone too) and the 7-row batch run already, and its matmuls' bits at up to 70 rows are checked per
    # kernel (tests/runner/test_quantized.py). What many rows and preemption add beyond that (the scheduler's
    # shapes, 64 sequences' attention) is the engine's, the same on every variant; the SIMD variants, whose
    # many-row paths are their own (tiles of rows), run those cases. The portable build is ~10x slower than
    # they are: these two cases alone took ~110 s of the suite on 2 cores.
    if variant == "portable":
        pytest.skip("its many-row passes are its 7-row case's (_skip_many_rows_on_portable)")


@pytest.mark.parametrize("num_others", [1, 7, 60])
def test_a_request_answers_the_same_alone_and_in_a_batch(setup, alone, num_others):
    if num_others > 8:
        _skip_many_rows_on_portable(setup)
    llm = LLM(max_num_seqs=64)
    prompts = _fillers(num_others) + PROBES
    got = _answers(llm.generate(prompts, PARAMS))[num_others:]
    assert got == alone


def test_the_same_with_prefill_chunked_small_and_a_prefix_cache_hit(setup, alone):
    # 24 tokens a step: every probe's prompt is split into chunks, differently from alone, and shares each
    # step with others' chunks and decodes. The second round finds the probes' prefixes in the cache.
    llm = LLM(max_num_seqs=64, max_num_batched_tokens=24)
    prompts = _fillers(9) + PROBES
    assert _answers(llm.generate(prompts, PARAMS))[9:] == alone
    again = llm.generate(PROBES + _fillers(5), PARAMS)[: len(PROBES)]
    assert any(output.num_cached_tokens > 0 for output in again)
    assert _answers(again) == alone


@pytest.mark.slow
def test_the_same_through_preemption(setup, alone):
    _skip_many_rows_on_portable(setup)
    # 20 blocks of 16 tokens cannot hold 24 sequences: the newest are preempted and recompute their context
    # in steps of other shapes.
    llm = LLM(max_num_seqs=64, num_kv_blocks=20, enable_prefix_caching=False)
    outputs = llm.generate(_fillers(20) + PROBES, PARAMS)
    assert llm.engine.num_preemptions > 0
    assert _answers(outputs)[20:] == alone
