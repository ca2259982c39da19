"""n / best_of sequences of one prompt: the followers fork the leader's prompt blocks instead of computing
the prompt again, and sample exactly what they would have sampled alone."""

from __future__ import annotations

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

PROMPTS = {"full-blocks": list(range(3, 35)), "partial-block": list(range(3, 40))}  # 32 and 37 tokens


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    path = tiny_model_factory("llama")[0]
    # Prefix caching off: whatever is shared here is shared by forking, not found in the cache.
    cache = CacheConfig(num_blocks=64, enable_prefix_caching=False)
    return Engine(EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=cache))


def _run(engine: Engine, prompt: list[int], share: bool, monkeypatch) -> tuple[dict[str, list[int]], int]:
    computed = []
    execute = engine.runner.execute
    monkeypatch.setattr(
        engine.runner, "execute", lambda batch: (computed.append(len(batch.token_ids)), execute(batch))[1]
    )
    for i in range(4):
        params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=6, ignore_eos=True, logprobs=0)
        engine.add_request(f"s-{i}", prompt, params, share_prompt_with="s-0" if share and i else None)
    tokens: dict[str, list[int]] = {f"s-{i}": [] for i in range(4)}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    monkeypatch.undo()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens, sum(computed)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_followers_fork_the_prompt_and_sample_the_same(engine, name, monkeypatch):
    prompt = PROMPTS[name]
    alone, computed_alone = _run(engine, prompt, share=False, monkeypatch=monkeypatch)
    shared, computed_shared = _run(engine, prompt, share=True, monkeypatch=monkeypatch)
    assert shared == alone
    assert len({tuple(t) for t in alone.values()}) > 1  # really four different samples
    # Alone: 4 prompts and 4 x 5 decode tokens; shared: 1 prompt, 3 recomputed last prompt tokens, decodes.
    assert computed_alone == 4 * len(prompt) + 4 * 5
    assert computed_shared == len(prompt) + 3 + 4 * 5


def test_followers_of_an_aborted_leader_compute_the_prompt_themselves(engine):
    prompt = PROMPTS["partial-block"]
    for i in range(3):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=3)
        engine.add_request(f"x-{i}", prompt, params, share_prompt_with="x-0" if i else None)
    engine.abort_request("x-0")
    engine.abort_request("x-2")
    finished = set()
    while engine.has_unfinished_requests():
        finished.update(o.request_id for o in engine.step() if o.finished)
    assert finished == {"x-1"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_offline_llm_best_of_and_beam_search(tiny_model_factory):
    from serval.entrypoints.llm import LLM

    llm = LLM(tiny_model_factory("llama")[0], dtype="float32", num_kv_blocks=64)
    prompt = {"prompt_token_ids": PROMPTS["partial-block"]}
    [sampled] = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=1, max_tokens=5))
    assert [o.index for o in sampled.outputs] == [0, 1]
    assert sampled.outputs[0].cumulative_logprob >= sampled.outputs[1].cumulative_logprob
    assert all(o.logprobs is None for o in sampled.outputs)  # ranked by logprobs, not asked for
    [beams] = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=5, use_beam_search=True))
    assert len(beams.outputs) == 3 and len({tuple(o.token_ids) for o in beams.outputs}) == 3
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
