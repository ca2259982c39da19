"""Speculative decoding with the rest of the engine, on a tiny random model (which soon repeats itself, so
prompt lookup drafts and the model accepts): a LoRA request, n seeded samples, beam search (which does not
speculate), preemption with a small KV cache, and a token budget shorter than a step's drafts all give the
answers of plain decoding, and every block comes back."""

from __future__ import annotations

import pytest

from serval.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    LoraModule,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, max_num_seqs=16)
PROMPTS = [[5, 17, 260, 3, 3, 99, 41, 8], [7, 7, 7, 120, 9], [300, 2, 44, 44, 44, 10, 11, 12, 13], [1, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _engine(directory, speculative=SpeculativeConfig(), num_blocks=256, budget=512, adapters=None) -> Engine:  # noqa: B008
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"),
            cache=CacheConfig(num_blocks=num_blocks, block_size=4),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
            lora=LoraConfig(
                enable_lora=True, lora_modules=tuple(LoraModule(n, p) for n, p in adapters.items())
            )
            if adapters
            else LoraConfig(),
            speculative=speculative,
        )
    )


def _run(engine: Engine, prompts, params, **kwargs) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, **kwargs)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def directory(tiny_model_factory):
    return tiny_model_factory("llama", False)[0]


def _accepted(engine: Engine) -> int:
    return engine.speculator.counters.num_accepted_tokens


def test_greedy_answers_alone_and_batched_are_plain(directory):
    expected = _run(_engine(directory), PROMPTS, GREEDY)
    engine = _engine(directory, NGRAM)
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert [_run(engine, [p], GREEDY)[0] for p in PROMPTS] == expected
    assert _accepted(engine) > 40


def test_a_lora_request_speculates_with_its_adapter(directory, tiny_lora_factory):
    adapters = {"full": tiny_lora_factory("full")[0]}
    expected = _run(_engine(directory, adapters=adapters), PROMPTS, GREEDY, lora_name="full")
    engine = _engine(directory, NGRAM, adapters=adapters)
    assert _run(engine, PROMPTS, GREEDY, lora_name="full") == expected
    assert expected != _run(_engine(directory), PROMPTS, GREEDY)  # the adapter matters
    assert _accepted(engine) > 0


def test_seeded_samples_reproduce(directory):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    engine = _engine(directory, NGRAM)
    first = _run(engine, PROMPTS, params)
    assert _run(engine, PROMPTS, params) == first
    assert all(len(tokens) == 30 for tokens in first)


def test_beam_search_does_not_speculate(directory):
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=12,
                            ignore_eos=True)  # fmt: skip
    engine = _engine(directory, NGRAM)
    engine.add_request("beam", PROMPTS[0], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.speculator.counters.num_drafts == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_a_small_cache_keeps_the_answers(directory):
    expected = _run(_engine(directory), PROMPTS, GREEDY)
    engine = _engine(directory, NGRAM, num_blocks=24)  # 4 x 48 tokens do not fit in 96 slots at once
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert engine.num_preemptions > 0 and _accepted(engine) > 0


def test_a_budget_shorter_than_the_drafts_trims_them(directory):
    expected = _run(_engine(directory), PROMPTS, GREEDY)
    engine = _engine(directory, NGRAM, budget=6)  # four decoding sequences and drafts for few of them
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert _accepted(engine) > 0
