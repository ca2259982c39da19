"""Response shapes of the app over a scripted engine: JSON, SSE framing and usage placement, auth, metrics,
/version."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serval.api import version
from tests.api.conftest import MODEL
from tests.api.invalid_cases import check_error

TEXT = "Hello there, friend."


def body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in response.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


def test_chat_completion_shape(client):
    response = client.post("/v1/chat/completions", json=body(max_tokens=100))
    assert response.status_code == 200
    data = response.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert isinstance(data["created"], int) and data["model"] == MODEL
    [choice] = data["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": TEXT, "tool_calls": None},
        "logprobs": None,
        "finish_reason": "stop",
    }
    usage = data["usage"]
    assert usage["completion_tokens"] == len(TEXT) + 1  # the bytes, then EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": 0, "text_tokens": usage["prompt_tokens"], "image_tokens": 0, "video_tokens": 0,
        "audio_tokens": 0,
    }  # fmt: skip
    assert len(usage["batch_size"]) == len(usage["queue_wait_time"]) == usage["completion_tokens"]
    assert isinstance(data["prefill_time"], float) and isinstance(data["decode_time_arr"], list)


def test_stream_without_stream_options_puts_usage_on_the_last_chunk(client):
    chunks = events(client.post("/v1/chat/completions", json=body(stream=True, max_tokens=100)))
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == TEXT
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert "usage" in chunks[-1] and all("usage" not in c for c in chunks[:-1])


def test_stream_include_usage_adds_a_final_chunk_with_no_choices(client):
    chunks = events(
        client.post("/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True}))
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all("usage" not in c for c in chunks[:-1])
    off = events(
        client.post("/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": False}))
    )
    assert all("usage" not in c for c in off)


def test_stream_n_choices_each_get_a_role_and_one_finish(make_client):
    client = make_client(["aaa", "bbb"])
    chunks = events(client.post("/v1/chat/completions", json=body(stream=True, n=2, seed=0, max_tokens=10)))
    for index, text in ((0, "aaa"), (1, "bbb")):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"].get("content", "") for m in mine) == text
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["stop"]
    assert [c["choices"][0]["index"] for c in chunks[:4]] == [0, 1, 0, 1]


def test_full_text_mode_sends_the_whole_text_so_far(make_client):
    client = make_client(full_text_enabled=True)
    chunks = events(client.post("/v1/chat/completions", json=body(stream=True, max_tokens=100)))
    contents = [c["choices"][0]["delta"]["content"] for c in chunks]
    assert all(TEXT.startswith(content) for content in contents)
    assert contents[-1] == TEXT and chunks[-1]["full_text"] == TEXT


def test_logprobs_shape(client):
    data = client.post("/v1/chat/completions", json=body(logprobs=True, top_logprobs=2, max_tokens=3)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_stop_and_max_tokens(client):
    data = client.post("/v1/chat/completions", json=body(stop=[", f"], max_tokens=100)).json()
    assert (data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]) == (
        "Hello there",
        "stop",
    )
    data = client.post("/v1/chat/completions", json=body(max_completion_tokens=5)).json()
    assert (data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]) == (
        "Hello",
        "length",
    )


def test_tool_history_and_tools_with_tool_choice_none_are_accepted(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "one"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    response = client.post(
        "/v1/chat/completions", json=body(messages=messages, tools=tools, tool_choice="none")
    )
    assert response.status_code == 200, response.text


def test_prefix_continuation_returns_only_the_continuation(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:", "prefix": True}]
    data = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).json()
    assert data["choices"][0]["message"]["content"] == TEXT


def test_completions_with_echo_and_several_prompts(client):
    data = client.post("/v1/completions", json={"model": MODEL, "prompt": ["A", "B"], "echo": True}).json()
    assert data["object"] == "text_completion"
    assert [c["text"] for c in data["choices"]] == ["A" + TEXT[:16], "B" + TEXT[:16]]
    assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
    chunks = events(client.post("/v1/completions", json={"model": MODEL, "prompt": [65, 66], "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TEXT[:16]


def test_models_tokenize_detokenize_health(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    check_error(client.get("/v1/models/other"), 404, "model")
    tokens = client.post("/tokenize", json={"prompt": "hé"}).json()
    assert tokens["tokens"] == list("hé".encode()) and tokens["count"] == 3
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hé"}
    chat_tokens = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "<|im_end|>"}]}
    ).json()
    assert chat_tokens["tokens"].count(257) == 1  # only the template's own end-of-turn
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("Basic k1", 401),
                                            ("Bearer k1", 200), ("Bearer k2", 200), ("bearer k2", 200)])  # fmt: skip
def test_api_keys(make_client, header, status):
    client = make_client(api_keys=("k1", "k2"))
    headers = {} if header is None else {"Authorization": header}
    for method, path, payload in [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", body()),
                                  ("GET", "/metrics", None), ("GET", "/version", None),
                                  ("POST", "/tokenize", {"prompt": "x"})]:  # fmt: skip
        response = client.request(method, path, headers=headers, json=payload)
        if status == 401:
            error = check_error(response, 401, None)
            assert error["code"] == "invalid_api_key"
        else:
            assert response.status_code == 200, response.text
    assert client.get("/health").status_code == 200


def test_metrics_count_requests_and_tokens(client):
    client.post("/v1/chat/completions", json=body(max_tokens=4))
    client.post("/v1/chat/completions", json=body(temperature=-1))
    text = client.get("/metrics").text
    assert 'serval_http_requests_total{path="/v1/chat/completions",status="200"} 1.0' in text
    assert 'serval_http_requests_total{path="/v1/chat/completions",status="400"} 1.0' in text
    assert "serval_generation_tokens_total 4.0" in text
    assert "serval_time_to_first_token_seconds_count 1.0" in text
    assert "serval_kv_cache_usage_perc 0.0" in text
    assert "serval_prefix_cache_hits_total" in text and "serval_num_requests_running" in text


# FakeEngine's runner facts; max_model_len is the engine's (256), not the runner's context (4096).
MODEL_FACTS = {
    "model": MODEL, "architecture": "FakeForCausalLM", "weight_format": "Q4_1+Q8_0", "dtype": "bfloat16",
    "kv_cache_dtype": "bfloat16", "device": "cpu", "kernel_variant": "avx2", "attention_backend": "native-cpu", "batch_activations": "int8",
    "num_threads": 3,
    "kv_cache_tokens": 320, "max_model_len": 256, "speculative_decoding": "off",
}  # fmt: skip


def test_model_info_gauge(client):
    # Parsed as Prometheus parses a scrape: a malformed exposition raises here.
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    info = families["serval_model_info"]
    assert info.type == "gauge"
    [sample] = info.samples
    assert sample.value == 1.0
    assert sample.labels == {name: str(value) for name, value in MODEL_FACTS.items()}


def test_version(client):
    response = client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("serval"), **MODEL_FACTS}


def test_version_without_package_metadata(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version.package_version() == "0.1.0"
