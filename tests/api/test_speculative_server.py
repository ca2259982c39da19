"""Speculative decoding through a real server on loopback (uvicorn, the real app, the real openai client, the
default model on the real engine with n-gram drafts): a request with drafts answers exactly as the same
request opted out (`"speculative_decoding": false`), streamed or not, free text, under a JSON schema, as a
forced tool call and with a stop string; /metrics counts the drafts under vLLM's names, /version says what
runs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serval.api.app import build_app
from serval.config import EngineConfig, SpeculativeConfig
from serval.engine.client import EngineClient
from serval.model_source import resolve_model
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from tests.api.chat_stream import stream_parts
from tests.fixtures.inprocess_server import serving

MODEL = "smol"
PASSAGE = (
    "Servals hunt rodents, birds and frogs in tall grass. They locate prey by sound, then leap up to three "
    "metres to pounce on it. A serval may catch a bird in flight."
)
COPY = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n{PASSAGE}"}]
OPT_OUT = {"speculative_decoding": False}
SPECULATIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "quote", "description": "Quote a text.",
          "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 60}},
                         "required": ["text"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    engine = EngineClient.start(EngineConfig(speculative=SPECULATIVE))
    try:
        tokenizer = Tokenizer.from_source(resolve_model(None))
        app = build_app(ServerConfig(served_model_names=(MODEL,)), Frontend(engine, tokenizer))
        with serving(app) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _drafts(server: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:spec_decode_num_drafts_total in /metrics")


def _both(client, server, **fields):
    """The same request with drafts and opted out; asserts that drafts were checked for the first only."""
    before = _drafts(server)
    drafted = client.chat.completions.create(model=MODEL, temperature=0.0, **fields)
    middle = _drafts(server)
    plain = client.chat.completions.create(model=MODEL, temperature=0.0, extra_body=OPT_OUT, **fields)
    assert middle > before and _drafts(server) == middle
    return drafted.choices[0], plain.choices[0]


def test_a_drafted_answer_is_the_plain_answer(client, server):
    drafted, plain = _both(client, server, messages=COPY, max_tokens=60, logprobs=True, top_logprobs=2)
    assert drafted.message.content == plain.message.content
    assert drafted.finish_reason == plain.finish_reason
    assert [(t.token, t.logprob) for t in drafted.logprobs.content] == [
        (t.token, t.logprob) for t in plain.logprobs.content
    ]


def test_streamed_drafts_fold_to_the_same_answer(client, server):
    _, plain = _both(client, server, messages=COPY, max_tokens=60)
    _, content, _, finish_reason = stream_parts(client, MODEL, COPY, temperature=0.0, max_tokens=60)
    assert content == plain.message.content and finish_reason == plain.finish_reason


def test_a_stop_string_inside_accepted_drafts(client, server):
    drafted, plain = _both(client, server, messages=COPY, max_tokens=80, stop=["three"])
    assert drafted.message.content == plain.message.content
    assert drafted.finish_reason == plain.finish_reason == "stop"


def test_a_json_schema_answer_is_the_plain_one(client, server):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    messages = [{"role": "user", "content": "Give a person as JSON: Ann, 31 years old."}]
    drafted, plain = _both(client, server, messages=messages, max_tokens=60, response_format=response_format)
    assert drafted.message.content == plain.message.content
    assert set(json.loads(drafted.message.content)) == {"name", "age"}


def test_a_forced_tool_call_is_the_plain_one(client, server):
    drafted, plain = _both(client, server, messages=COPY, max_tokens=80, tools=TOOLS, tool_choice="required")
    assert drafted.finish_reason == plain.finish_reason == "tool_calls"
    [call], [plain_call] = drafted.message.tool_calls, plain.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        plain_call.function.name,
        plain_call.function.arguments,
    )


def test_metrics_and_version_say_what_runs(server):
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"vllm:spec_decode_{name}_total{{" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="3"}' in text
    version = httpx.get(f"{server}/version", timeout=10).json()
    assert version["speculative_decoding"].startswith("ngram (up to 4 drafts, n-grams of 1-8")
