"""logit_bias from SamplingParams through the engine to the sampler, on a tiny random-weight model: a +100
bias forces its token, -100 bans the greedy one, each request keeps its own bias in a shared batch, and ids
outside the vocabulary are refused before anything runs."""

from __future__ import annotations

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> Engine:
    directory, _ = tiny_model_factory("llama")
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=32)
    )
    return Engine(config)


def _run(engine: Engine, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    return outputs


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **fields)


def test_bias_forces_and_bans_per_request_in_one_batch(engine):
    [plain] = _run(engine, {"alone": greedy()}).values()
    assert 200 not in plain  # else forcing it would prove nothing
    outputs = _run(
        engine,
        {
            "plain": greedy(),
            "forced": greedy(logit_bias={200: 100.0}),
            "sampled-forced": SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={"201": 100}),
            "banned": greedy(logit_bias={plain[0]: -100.0}),
        },
    )
    assert outputs["plain"] == plain  # a neighbour's bias does not leak into this row
    assert outputs["forced"] == [200] * 6
    assert outputs["sampled-forced"] == [201] * 6
    assert outputs["banned"][0] != plain[0]
    assert plain[0] not in outputs["banned"]


def test_ids_outside_the_vocabulary_are_refused(engine):
    vocab_size = engine.runner.info.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("too-far", PROMPT, greedy(logit_bias={vocab_size: 1.0}))
    assert not engine.has_unfinished_requests()
    _run(engine, {"last-id": greedy(logit_bias={vocab_size - 1: 1.0})})  # the last id is fine


def test_sampling_params_freeze_and_check_the_bias():
    params = SamplingParams(logit_bias={"9": 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=[(9, 1.0), (2, -3.5)]))
    for bad in ({1: 100.5}, {1: float("nan")}, {-1: 1.0}, {"x": 1.0}, [(1, 1.0), (1, 2.0)]):
        with pytest.raises(ValueError):
            SamplingParams(logit_bias=bad)
    for bad in ({1.5: 1.0}, {True: 1.0}):  # never truncated into an id
        with pytest.raises(TypeError):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, logit_bias={1: 1.0})
