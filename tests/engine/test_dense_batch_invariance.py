"""Batch invariance of dense checkpoints: a greedy request's tokens and logprobs on a safetensors model (fp32 and
bf16 weights) are bitwise the same alone, beside 1..15 other prompts and with its prompt chunked small, on
every kernel variant this CPU runs (kernels.dense_linear: docs/architecture.md, "Batch invariance").

The fp32 checkpoints (a dense MLP and, Qwen3-MoE, dense experts) run in fp32 (an untied head: a Linear)
with the default flags, the bf16 one in bf16 (a tied head, biases on q/k/v) with `deterministic=True`
(`--deterministic`): without it bf16 weights take
oneDNN's GEMM, faster at 64 rows, whose order over K follows the row count. The best variant runs in the
quick suite, the rest under `slow`.
"""

from __future__ import annotations

import pytest
import torch

from serval import LLM, SamplingParams
from serval.runner.kernels import runnable_variants
from tests.fixtures.kernels import VARIANT_NAMES, require_kernels

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
PROBES = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4 5 6 7 8 9 10 11 12 13 14"]
CHECKPOINTS = {  # setup name (its compute dtype, but for the "moe-" prefix) -> (architecture, tied, dtype)
    "float32": ("llama", False, torch.float32),
    "bfloat16": ("qwen2", True, torch.bfloat16),
    # dense experts: how many tokens choose an expert changes with the batch, its rows' bits must not
    "moe-float32": ("qwen3_moe", False, torch.float32),
}


def _answers(outputs) -> list[tuple]:
    """Each request's token ids and every logprob it reported (the chosen token's and its top 2)."""
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outputs]


def _fillers(count: int) -> list[str]:
    """Other prompts of other lengths, longer and shorter than the probes."""
    words = ["sea", "stone", "river light", "a long road north", "seven"]
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + 3 * (i % 6))) for i in range(count)]


def _setups() -> list:
    best = runnable_variants()[0].name if runnable_variants() else None
    return [
        pytest.param(
            (variant, dtype), id=f"{variant}-{dtype}", marks=() if variant == best else (pytest.mark.slow,)
        )
        for variant in VARIANT_NAMES
        for dtype in CHECKPOINTS
    ]


@pytest.fixture(scope="module", params=_setups())
def setup(request, tiny_model_factory):
    """(model directory, compute dtype); LLM instances made inside it run on the variant."""
    variant, dtype = request.param
    require_kernels(variant)
    directory, _ = tiny_model_factory(*CHECKPOINTS[dtype])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_KERNEL_VARIANT", variant)
        yield directory, dtype


def _llm(setup, **kwargs) -> LLM:
    # bf16 weights are batch-invariant with --deterministic (fp32 ones by default): the docstring says why
    directory, name = setup
    dtype = name.removeprefix("moe-")
    return LLM(model=directory, dtype=dtype, max_num_seqs=16, deterministic=dtype == "bfloat16", **kwargs)


@pytest.fixture(scope="module")
def alone(setup) -> list[tuple]:
    llm = _llm(setup)
    assert not llm.engine.runner.has_packed_weights  # every matrix is dense
    return [_answers(llm.generate(prompt, PARAMS))[0] for prompt in PROBES]


@pytest.mark.parametrize("num_others", [1, 5, 13])
def test_a_request_answers_the_same_alone_and_in_a_batch(setup, alone, num_others):
    prompts = _fillers(num_others) + PROBES
    assert _answers(_llm(setup).generate(prompts, PARAMS))[num_others:] == alone


def test_the_same_with_prefill_chunked_small(setup, alone):
    # 8 tokens a step: each probe's prompt is split into chunks, differently from alone, and shares steps
    # with others' chunks and decodes.
    llm = _llm(setup, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _answers(llm.generate(_fillers(6) + PROBES, PARAMS))[6:] == alone


def test_speculative_decoding_answers_as_plain_decoding(setup, alone):
    # Verifying k+1 tokens of a sequence in one step gives plain decoding's tokens and logprobs only if a
    # token's logits do not depend on how many rows its step had. Prompts that repeat themselves, so that the
    # n-gram drafter proposes tokens.
    llm = _llm(
        setup, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    )
    prompts = [(p + " ") * 3 for p in PROBES]
    expected = _answers(_llm(setup).generate(prompts, PARAMS))
    assert _answers(llm.generate(prompts, PARAMS)) == expected
    assert llm.engine.speculator.counters.num_draft_tokens > 0
