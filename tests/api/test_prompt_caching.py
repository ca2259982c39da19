"""Explicit prompt caching through the real app (in process) and the real engine on a tiny model: cache_control
writes the prefix into the explicit cache (cache_creation), and the next request with that prefix hits it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serval.api.app import build_app
from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.client import EngineClient
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer

MODEL = "tiny"
BLOCK_SIZE = 16
SYSTEM = "You are a careful assistant who answers questions about the long manual below. " * 3


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen2")
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE),
    )
    engine = EngineClient.start(config)
    frontend = Frontend(engine, Tokenizer.from_directory(directory))
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(ServerConfig(served_model_names=(MODEL,)), frontend)),
        base_url="http://test",
        timeout=60,
    )
    yield loop, client, engine
    loop.run_until_complete(client.aclose())
    loop.close()
    engine.shutdown()


def post(app, body: dict) -> httpx.Response:
    loop, client, _ = app
    payload = {"model": MODEL, "max_tokens": 2, "temperature": 0.0, **body}
    return loop.run_until_complete(client.post("/v1/chat/completions", json=payload))


def cached_messages(question: str, control: object = None) -> list[dict]:
    part = {"type": "text", "text": SYSTEM, "cache_control": control or {"type": "ephemeral"}}
    return [{"role": "system", "content": [part]}, {"role": "user", "content": question}]


def test_cache_control_creates_then_hits(app):
    response = post(app, {"messages": cached_messages("What is chapter one about?")})
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["prompt_tokens_details"]
    created = details["cache_creation_input_tokens"]
    # The system prompt's full blocks (the prefix up to the end of the marked part), pinned.
    assert created >= BLOCK_SIZE and created % BLOCK_SIZE == 0
    assert details["cache_creation"] == {"ephemeral_5m_input_tokens": created}
    assert details["cache_type"] == "ephemeral"
    assert app[2].stats().num_pinned_blocks == created // BLOCK_SIZE

    second = post(app, {"messages": cached_messages("And chapter two?")}).json()["usage"]
    details = second["prompt_tokens_details"]
    assert details["cached_tokens"] >= created
    assert details["cache_creation_input_tokens"] == 0  # refreshed, not written again
    assert details["cache_type"] == "ephemeral"


def test_streamed_usage_has_the_cache_fields(app):
    body = {
        "messages": cached_messages("A streamed question?"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = post(app, body)
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cache_type"] == "ephemeral"
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_without_cache_control_there_are_no_cache_fields(app):
    response = post(app, {"messages": [{"role": "user", "content": "Plain question"}]})
    details = response.json()["usage"]["prompt_tokens_details"]
    assert set(details) == {"cached_tokens", "text_tokens", "image_tokens", "video_tokens", "audio_tokens"}
