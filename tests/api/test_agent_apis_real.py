"""The Responses and Messages APIs on the real engine running a tiny random-weight thinking model (Qwen3
shape, a <think> template), through the official openai and anthropic clients on loopback: reasoning comes
back as reasoning items / signed thinking blocks, a json_schema text format and forced tool calls are
grammar-valid, and hostile bodies on the new routes are 4xx in each route's own error shape, never 5xx,
with every KV block free afterwards and the server still serving."""

from __future__ import annotations

import json
import os

import anthropic
import httpx
import jsonschema
import openai
import pytest

from serval.api.app import build_app
from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.client import EngineClient
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from tests.fixtures.inprocess_server import serving
from tests.fixtures.tiny_models import write_tiny_model

MODEL = "tiny-thinker"
BUDGET = 6
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-thinker"))
    write_tiny_model(directory, "qwen3", thinking=True)
    # room for the tools' system prompt (the byte-level tiny vocabulary spends a token on most characters);
    # the weights do not depend on it
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "max_position_embeddings": 2048}, f)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")
        engine = EngineClient.start(
            EngineConfig(
                model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=64)
            )
        )
    try:
        frontend = Frontend(engine, Tokenizer.from_directory(directory))
        with serving(build_app(ServerConfig(served_model_names=(MODEL,)), frontend)) as port:
            base = f"http://127.0.0.1:{port}"
            yield (openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120),
                   anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120), engine, base)  # fmt: skip
    finally:
        engine.shutdown()


def _all_blocks_free(engine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_responses_reasoning_json_and_tools(real):
    client, _, engine, _ = real
    fields = {"model": MODEL, "input": "Where?", "max_output_tokens": 60, "temperature": 1.0, "seed": 3}
    response = client.responses.create(
        **{k: v for k, v in fields.items() if k != "seed"}, extra_body={"seed": 3, "thinking_budget": BUDGET},
        text={"format": {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}},
    )  # fmt: skip
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and response.output[0].content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), WEATHER)
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}]
    fields = {"model": MODEL, "input": "Weather?", "tools": tools, "tool_choice": "required",
              "max_output_tokens": 120, "temperature": 1.0}  # fmt: skip
    num_calls = 0
    for seed in range(4):
        extra = {"seed": seed, "thinking_budget": BUDGET}
        called = client.responses.create(**fields, extra_body=extra)
        events = list(client.responses.create(**fields, stream=True, extra_body=extra))
        streamed = events[-1].response
        # seeded: the stream is the same answer, item for item
        assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == [
            (i.type, getattr(i, "arguments", None)) for i in called.output
        ]
        for item in called.output:
            if item.type != "function_call":
                continue
            # a random model may idle in the whitespace JSON allows until the token cap cuts the call
            assert item.name == "weather" and item.arguments.lstrip().startswith("{")
            if called.status == "completed":
                jsonschema.validate(json.loads(item.arguments), WEATHER)
            num_calls += 1
    assert num_calls > 0
    assert _all_blocks_free(engine)


def test_messages_thinking_and_tools(real):
    _, client, engine, _ = real
    user = [{"role": "user", "content": "Hello"}]
    # greedy (the Messages API has no seed): the stream must be the same answer
    message = client.messages.create(model=MODEL, max_tokens=40, messages=user, extra_body={"temperature": 0.0},
                                     thinking={"type": "enabled", "budget_tokens": BUDGET})  # fmt: skip
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    with client.messages.stream(model=MODEL, max_tokens=40, messages=user, extra_body={"temperature": 0.0},
                                thinking={"type": "enabled", "budget_tokens": BUDGET}) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    first = streamed.content[0]
    assert (first.type, first.thinking) == ("thinking", thinking.thinking)
    assert streamed.content[0].signature == thinking.signature
    # without thinking the template's <think> is closed: no thinking block
    plain = client.messages.create(model=MODEL, max_tokens=8, messages=user)
    assert all(b.type == "text" for b in plain.content)
    tools = [{"name": "weather", "input_schema": WEATHER}]
    called = client.messages.create(model=MODEL, max_tokens=80, messages=user, tools=tools,
                                    tool_choice={"type": "tool", "name": "weather"})  # fmt: skip
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "weather" and called.stop_reason in ("tool_use", "max_tokens")
    if called.stop_reason == "tool_use":  # a random model may idle in JSON's whitespace until the cap
        jsonschema.validate(use.input, WEATHER)
    history = [
        *user,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    assert (
        client.messages.create(model=MODEL, max_tokens=4, messages=history, tools=tools).content is not None
    )
    assert _all_blocks_free(engine)


DEEP = "[" * 10_000 + "]" * 10_000
RESPONSES_HOSTILE = [
    b'{"model": "tiny-thinker", "input": [',
    b"[1, 2]",
    {"input": "hi"},
    {"model": MODEL},
    {"model": MODEL, "input": 5},
    {"model": MODEL, "input": []},
    {"model": MODEL, "input": [5]},
    {"model": MODEL, "input": [{"type": "computer_call"}]},
    {"model": MODEL, "input": [{"type": "message", "role": "user", "content": [{"type": "input_file"}]}]},
    {"model": MODEL, "input": [{"type": "message", "role": "hacker", "content": "x"}]},
    {"model": MODEL, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
    {"model": MODEL, "input": [{"type": "function_call_output", "output": "3"}]},
    {"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]},
    {
        "model": MODEL,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}],
    },
    {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]},
    {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
    {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f" * 100}]},
    {"model": MODEL, "input": "hi", "tool_choice": {"type": "function", "name": "g"}},
    {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
    {"model": MODEL, "input": "hi", "text": {"format": {"type": "xml"}}},
    {"model": MODEL, "input": "hi", "max_output_tokens": 0},
    {"model": MODEL, "input": "hi", "temperature": 3},
    {"model": MODEL, "input": "hi", "background": True},
    {"model": MODEL, "input": "hi", "store": True},
    {"model": MODEL, "input": "hi", "previous_response_id": "resp_x"},
    {"model": MODEL, "input": "x " * 20_000},
    {"model": MODEL, "input": json.loads(DEEP[:200] + DEEP[-200:])},
    {"model": "other", "input": "hi"},
]
MESSAGES_HOSTILE = [
    b'{"model": "tiny-thinker", "messages": [',
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    {"model": MODEL, "max_tokens": 4, "messages": []},
    {"model": MODEL, "max_tokens": 4, "messages": [5]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA"}}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "bash_20250124", "name": "bash"}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
     "tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5}}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "x"}},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
     "thinking": {"type": "enabled", "budget_tokens": 10}},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [5]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x " * 20_000}]},
    {"model": MODEL, "max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "hi"}]},
]  # fmt: skip


def _post(base: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=content, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_hostile_bodies_are_4xx_in_each_routes_shape(real, stream):
    client, _, engine, base = real
    for body in RESPONSES_HOSTILE:
        sent = body if isinstance(body, bytes) else {**body, "stream": stream}
        response = _post(base, "/v1/responses", sent)
        assert 400 <= response.status_code < 500, (body, response.text[:300])
        error = response.json()["error"]
        assert error["type"] in ("invalid_request_error", "not_found_error") and len(error["message"]) < 500
    for body in MESSAGES_HOSTILE:
        sent = body if isinstance(body, bytes) else {**body, "stream": stream}
        response = _post(base, "/v1/messages", sent)
        assert 400 <= response.status_code < 500, (body, response.text[:300])
        data = response.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        assert _post(base, "/v1/messages/count_tokens", sent).status_code < 500
    assert client.responses.create(model=MODEL, input="still here?", max_output_tokens=2).output
    assert _all_blocks_free(engine)
