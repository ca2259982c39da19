"""Every invalid request of the table gets its 4xx and an OpenAI error body, and the values at both ends of
every accepted range get a 200 (in process, scripted engine)."""

from __future__ import annotations

import json

import pytest

from serval.api.openai import MAX_MESSAGES_CHARS
from serval.server_config import ServerConfig
from tests.api import hostile_cases
from tests.api.conftest import MODEL, AppClient
from tests.api.invalid_cases import cases, check_error, encode
from tests.serving.fakes import FakeEngine

CASES = cases(MODEL)


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request(client, path, body, status, param):
    response = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    check_error(response, status, param)


def test_wrong_method_and_unknown_route_have_error_bodies(client):
    check_error(client.get("/v1/chat/completions"), 405, None)
    check_error(client.get("/v1/nothing"), 404, None)


def test_body_over_the_limit_is_413(make_client):
    client = make_client(max_request_body_bytes=1000)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}
    error = check_error(client.post("/v1/chat/completions", json=body), 413, None)
    assert "1000" in error["message"]


def test_full_queue_is_429_with_retry_after(client):
    client.engine.is_queue_full = True
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        response = client.post("/v1/chat/completions", json=body)
        check_error(response, 429, None)
        assert response.headers["retry-after"] == "1"


LOGIT_BIAS_KEYS = {
    "logit-bias-key-word": "abc",
    "logit-bias-key-negative": "-1",
    "logit-bias-key-outside-vocab": "999999999",
    "logit-bias-key-leading-zero": "05",
    "logit-bias-key-float": "5.0",
    "logit-bias-key-huge": "9" * 32,  # shown cut short
    "logit-bias-value-high": "5",
    "logit-bias-value-string": "5",
    "logit-bias-value-huge": "5",
    "logit-bias-value-overflow": "5",
}


@pytest.mark.parametrize("case_id, key", LOGIT_BIAS_KEYS.items())
def test_logit_bias_errors_name_the_key(client, case_id, key):
    [(_, path, body, status, param)] = [c for c in CASES if c[0] == case_id]
    response = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    error = check_error(response, status, param)
    assert repr(key) in error["message"], error
    assert len(error["message"]) < 200  # nothing huge is echoed


# Both ends of every range (docs/api.md, "Accepted ranges"), and the values only one spec allows (the union).
EDGES = [
    {"temperature": 0.0},
    {"temperature": 1e6},
    {"top_p": 1.0},
    {"top_p": 1e-7},  # Model Studio's (0, 1]; MindIE's (1e-6, 1] would refuse it
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 2**31 - 1},
    {"repetition_penalty": 2.0},
    {"repetition_penalty": 2.5},  # Model Studio: any value above 0; MindIE's (0, 2] would refuse it
    {"repetition_penalty": 1e-9},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"max_tokens": 2**31 - 1},
    {"max_completion_tokens": 2**31 - 1},
    {"n": 128, "temperature": 1.0, "max_tokens": 1},
    {"best_of": 128, "temperature": 1.0, "max_tokens": 1},
    {"logprobs": True, "top_logprobs": 20},
    {"top_logprobs": 0},
    {"min_p": 1.0},
    {"min_tokens": 0},
    {"stop": ["x" * 32768]},
    {"thinking_budget": 1},
    {"logit_bias": {"0": -100, "257": 100}},  # the fake tokenizer's whole vocabulary: [0, 258)
    {"logit_bias": {"5": 0.5, "6": -99.99}},
    {"logit_bias": {}},
]
COMPLETION_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "n",
    "logit_bias",
}


@pytest.mark.parametrize("fields", EDGES, ids=[json.dumps(f)[:60] for f in EDGES])
def test_values_at_the_ends_of_their_ranges_are_accepted(client, fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    completion.update({k: v for k, v in fields.items() if k in COMPLETION_FIELDS})
    response = client.post("/v1/completions", json=completion)
    assert response.status_code == 200, response.text


def test_messages_over_4_mib_of_text_are_refused(make_client):
    client = make_client(max_request_body_bytes=16 * 1024 * 1024)
    half = "x" * (MAX_MESSAGES_CHARS // 2)
    messages = [{"role": "user", "content": half}, {"role": "assistant", "content": half + "y"}]
    error = check_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400,
                        "messages")  # fmt: skip
    assert str(MAX_MESSAGES_CHARS) in error["message"]
    # At the limit the text is accepted; what refuses it then is the context length, with its own message.
    messages[1]["content"] = half
    error = check_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400,
                        "messages")  # fmt: skip
    assert "context length" in error["message"]


HOSTILE = hostile_cases.cases(MODEL)


@pytest.fixture
def roomy_client():
    """A client whose scripted engine holds 4096 tokens, room for a prompt that offers tools."""
    client = AppClient(ServerConfig(served_model_names=(MODEL,)), FakeEngine(["Hello."], max_model_len=4096))
    yield client
    client.close()


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_request(roomy_client, path, body, status, param):
    client = roomy_client
    response = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    hostile_cases.check_answer(response, status, param)
