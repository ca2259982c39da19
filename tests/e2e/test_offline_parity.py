"""The offline LLM and a real `serval serve` of the same tiny model answer the same requests the same way: one
serving code path (serving/generation.py) drives both, so greedy and seeded outputs, finish reasons, usage
counts and a refusal's message must be equal. The server is driven by the real `openai` client on loopback."""

from __future__ import annotations

import openai
import pytest

from serval.sampling import SamplingParams
from serval.serving.errors import InvalidRequestError
from tests.e2e.conftest import running_server

MODEL = "tiny"
MAX_MODEL_LEN = 96
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away"]
TOKEN_PROMPT = [5, 40, 41, 42, 300, 301, 17, 99]
ENGINE_FLAGS = {"num_kv_blocks": 64, "max_model_len": MAX_MODEL_LEN}


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny):
    log_path = tmp_path_factory.mktemp("parity-server") / "server.log"
    args = ["--model", tiny, "--served-model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "64",
            "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning"]  # fmt: skip
    with running_server(args, log_path) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny):
    from serval.entrypoints.llm import LLM

    return LLM(tiny, dtype="float32", **ENGINE_FLAGS)


def offline(llm, prompt, **params):
    [result] = llm.generate(prompt, SamplingParams(**params))
    return result


def served(client, prompt, **params):
    return client.completions.create(model=MODEL, prompt=prompt, **params)


def assert_same(result, response) -> None:
    assert [o.text for o in result.outputs] == [c.text for c in response.choices]
    assert [o.finish_reason for o in result.outputs] == [c.finish_reason for c in response.choices]
    assert result.usage.num_prompt_tokens == response.usage.prompt_tokens
    assert result.usage.num_completion_tokens == response.usage.completion_tokens


@pytest.mark.parametrize("prompt", [*PROMPTS, TOKEN_PROMPT])
def test_greedy_outputs_and_usage_match(llm, client, prompt):
    result = offline(llm, prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt},
                     temperature=0.0, max_tokens=12)  # fmt: skip
    response = served(client, prompt, temperature=0.0, max_tokens=12)
    assert result.outputs[0].text  # random weights, but some text
    assert_same(result, response)


def test_seeded_best_of_matches(llm, client):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 10, "n": 2}
    result = offline(llm, PROMPTS[1], best_of=3, **params)
    response = served(client, PROMPTS[1], best_of=3, **params)
    assert len(result.outputs) == 2
    assert_same(result, response)  # the same 2 of 3, in the same order, and the 3 counted in usage


def test_stop_string_matches(llm, client):
    greedy = offline(llm, PROMPTS[0], temperature=0.0, max_tokens=12).outputs[0].text
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    result = offline(llm, PROMPTS[0], temperature=0.0, max_tokens=12, stop=[stop])
    response = served(client, PROMPTS[0], temperature=0.0, max_tokens=12, stop=[stop])
    assert result.outputs[0].finish_reason == "stop" and result.outputs[0].stop_reason == stop
    assert_same(result, response)


def test_a_prompt_near_the_context_ends_with_length(llm, client):
    prompt = [7 + i % 200 for i in range(MAX_MODEL_LEN - 3)]
    result = offline(llm, {"prompt_token_ids": prompt}, temperature=0.0, max_tokens=20)
    response = served(client, prompt, temperature=0.0, max_tokens=20)
    assert result.outputs[0].finish_reason == "length" and len(result.outputs[0].token_ids) == 3
    assert_same(result, response)


def test_a_refused_prompt_has_the_same_message(llm, client):
    prompt = [7] * MAX_MODEL_LEN
    with pytest.raises(InvalidRequestError) as refused:
        offline(llm, {"prompt_token_ids": prompt}, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as answered:
        served(client, prompt, max_tokens=4)
    error = answered.value.response.json()["error"]
    assert error["message"] == str(refused.value) and "maximum context length" in error["message"]
    assert error["param"] == refused.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


def test_a_batch_refused_by_the_engine_leaves_nothing_running(llm):
    engine = llm.engine
    vocab_size = engine.runner.info.vocab_size
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [vocab_size + 5]}], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The engine is still usable afterwards and answers as before.
    assert offline(llm, PROMPTS[0], temperature=0.0, max_tokens=4).outputs[0].finish_reason == "length"
