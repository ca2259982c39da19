"""Sampled speculative decoding keeps the target's distribution: thousands of three-token answers of a tiny
random model at temperature 1 (top-k 4, so every answer is one of 64), drafted by the model itself (two
drafts a step, often rejected), against the exact joint distribution the plain engine's logprobs give. A
chi-square test; the same test run on a broken acceptance rule (every draft kept) must fail it, so it has
the power to see a wrong rule."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from serval.engine.engine import Engine
from serval.engine.speculation.speculator import Speculator
from serval.sampling import SamplingParams

PROMPT = [5, 17, 260, 3, 3, 99, 41, 8]
TOP_K = 4
NUM_ANSWERS = 3000
SAMPLED = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)


def _engine(directory: str, speculative: SpeculativeConfig | None = None) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"),
            cache=CacheConfig(num_blocks=2048, block_size=4),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            speculative=speculative or SpeculativeConfig(),
        )
    )


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            logprobs[output.request_id].extend(output.new_logprobs or [])
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


def _next_token_distribution(engine: Engine, contexts: list[list[int]]) -> list[dict[int, float]]:
    """Plain decoding's distribution of the token after each context: its top-k raw logprobs, renormalized
    (temperature 1, top-k only)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_K, ignore_eos=True)
    _, logprobs = _run(engine, contexts, params)
    distributions = []
    for (entry,) in logprobs:
        total = sum(math.exp(lp) for _, lp in entry.top)
        distributions.append({token: math.exp(lp) / total for token, lp in entry.top})
    return distributions


def _exact_joint(engine: Engine) -> dict[tuple[int, ...], float]:
    (first,) = _next_token_distribution(engine, [PROMPT])
    seconds = dict(zip(first, _next_token_distribution(engine, [PROMPT + [t] for t in first])))
    pairs = [(a, b) for a in first for b in seconds[a]]
    thirds = dict(zip(pairs, _next_token_distribution(engine, [PROMPT + list(p) for p in pairs])))
    return {
        (a, b, c): first[a] * seconds[a][b] * thirds[(a, b)][c] for (a, b) in pairs for c in thirds[(a, b)]
    }


def _chi_square_z(counts: Counter, expected: dict[tuple[int, ...], float], num: int) -> float:
    """The chi-square statistic of the counts against the expected probabilities, as a z-score
    (Wilson-Hilferty); cells expected under 5 times are pooled, answers outside the support count there."""
    statistic, pooled_observed, pooled_expected, num_cells = 0.0, 0, 0.0, 0
    for cell, probability in expected.items():
        if probability * num < 5:
            pooled_observed += counts[cell]
            pooled_expected += probability * num
            continue
        statistic += (counts[cell] - probability * num) ** 2 / (probability * num)
        num_cells += 1
    pooled_observed += sum(n for cell, n in counts.items() if cell not in expected)
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / max(pooled_expected, 1.0)
        num_cells += 1
    df = num_cells - 1
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    directory, _ = tiny_model_factory("llama", False)
    expected = _exact_joint(_engine(directory))
    drafted = _engine(
        directory,
        SpeculativeConfig(method="draft_model", model=directory, num_speculative_tokens=2, max_num_seqs=64),
    )
    return drafted, expected


def _sampled_counts(engine: Engine) -> Counter:
    answers, _ = _run(engine, [PROMPT] * NUM_ANSWERS, SAMPLED)
    return Counter(tuple(answer) for answer in answers)


def test_sampled_answers_follow_the_targets_distribution(setup):
    engine, expected = setup
    before = engine.speculator.counters.num_draft_tokens, engine.speculator.counters.num_accepted_tokens
    counts = _sampled_counts(engine)
    num_drafts = engine.speculator.counters.num_draft_tokens - before[0]
    num_accepted = engine.speculator.counters.num_accepted_tokens - before[1]
    # A draft was checked for every answer's second token (the third is the cap's), kept and rejected often.
    assert num_drafts == NUM_ANSWERS
    assert 0.1 < num_accepted / num_drafts < 0.9
    assert _chi_square_z(counts, expected, NUM_ANSWERS) < 4.0


def test_the_check_sees_a_wrong_acceptance_rule(setup, monkeypatch):
    engine, expected = setup

    def keep_every_draft(self, request, sampled):
        return len(request.draft_token_ids)

    monkeypatch.setattr(Speculator, "accepted_length", keep_every_draft)
    assert _chi_square_z(_sampled_counts(engine), expected, NUM_ANSWERS) > 8.0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
