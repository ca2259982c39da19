"""Reasoning end to end on a tiny random-weight model with a thinking chat template, through the real app
(in process) and the real engine: the <think> split, the thinking budget, and the reasoning token count are
the same streamed or not."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from serval.api.app import build_app
from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.client import EngineClient
from serval.sampling import SamplingParams
from serval.server_config import ServerConfig
from serval.serving.chat import ChatOptions, ChatPrompt
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from tests.fixtures.tiny_models import write_tiny_model

MODEL = "tiny-thinker"
BUDGET = 5


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-thinker"))
    write_tiny_model(directory, "qwen3", thinking=True)
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=64)
    )
    engine = EngineClient.start(config)
    tokenizer = Tokenizer.from_directory(directory)
    frontend = Frontend(engine, tokenizer)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(ServerConfig(served_model_names=(MODEL,)), frontend)),
        base_url="http://test",
        timeout=60,
    )
    yield loop, client, tokenizer, frontend
    loop.run_until_complete(client.aclose())
    loop.close()
    engine.shutdown()


def post(app, body: dict) -> dict:
    loop, client, *_ = app
    response = loop.run_until_complete(client.post("/v1/chat/completions", json={"model": MODEL, **body}))
    assert response.status_code == 200, response.text
    return response.json()


def post_stream(app, body: dict) -> tuple[str, str, dict]:
    loop, client, *_ = app

    async def read() -> list[dict]:
        chunks = []
        request = client.build_request(
            "POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, **body}
        )
        response = await client.send(request, stream=True)
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
        return chunks

    chunks = loop.run_until_complete(read())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, chunks[-1]["usage"]


BODY = {"messages": [{"role": "user", "content": "hello"}], "seed": 7, "max_tokens": 24, "ignore_eos": True}


def test_budget_forces_the_end_tag_and_the_split_is_the_same_streamed(app):
    loop, _, tokenizer, frontend = app
    messages = BODY["messages"]
    options = ChatOptions(thinking_budget=BUDGET)
    params = SamplingParams(seed=7, max_tokens=24, ignore_eos=True)
    request = loop.run_until_complete(frontend.chat_request("r", ChatPrompt(messages), options, params))
    assert request.output_plan.starts_in_reasoning  # the template opened <think>
    choice = loop.run_until_complete(frontend.result(request)).choices[0]
    end_ids = tokenizer.encode("\n</think>\n\n")
    assert choice.token_ids[BUDGET : BUDGET + len(end_ids)] == end_ids  # the end tag came right at the budget
    assert choice.reasoning_text == tokenizer.decode(choice.token_ids[:BUDGET]).strip()
    assert choice.text == tokenizer.decode(choice.token_ids[BUDGET + len(end_ids) :]).lstrip()

    result = post(app, {**BODY, "thinking_budget": BUDGET})
    message = result["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (choice.reasoning_text, choice.text)
    details = result["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == BUDGET + len(tokenizer.encode("\n</think>"))
    reasoning, content, usage = post_stream(app, {**BODY, "thinking_budget": BUDGET})
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert usage["completion_tokens_details"] == details


def test_thinking_disabled_gives_no_reasoning(app):
    result = post(app, {**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    message = result["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert result["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_structured_output_after_reasoning(app):
    properties = {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}
    schema = {
        "type": "object",
        "properties": properties,
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 300, "thinking_budget": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}  # fmt: skip
    for seed in range(3):
        result = post(app, {**body, "seed": seed})
        choice = result["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert result["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 4
