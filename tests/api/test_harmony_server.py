"""Harmony (gpt-oss's format) through a real server on loopback (uvicorn, the real app, the real openai client).

A scripted engine generates harmony text in the tiny harmony tokenizer's ids (special tokens as such): the
analysis comes back as reasoning_content, the final message as content, a commentary call as tool_calls with
finish_reason "tool_calls", streamed deltas fold to the message. A tiny random-weight model with the same
tokenizer and template, on the real engine, makes forced calls that are harmony calls with schema-valid
arguments (the grammar writes the structure tokens; <|call|> ends generation; a thinking budget ends the
analysis)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import jsonschema
import openai
import pytest

from serval.api.app import build_app
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from tests.api.chat_stream import stream_parts
from tests.fixtures.inprocess_server import serving
from tests.fixtures.tiny_models import write_tiny_model
from tests.serving.fakes import FakeEngine

MODEL = "tiny-harmony"
# A random model never ends its analysis by itself: the budget forces <|end|><|start|>assistant, and the grammar
# the call after it.
BUDGET = 6
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now.",
                                           "parameters": WEATHER, "strict": True}}]  # fmt: skip
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = (
    "<|channel|>analysis<|message|>The user wants a sentence.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)
CALL = (
    "<|channel|>analysis<|message|>I should look it up.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}<|call|>'
)


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tiny-harmony"))
    write_tiny_model(directory, "gpt_oss", harmony=True)  # gpt-oss itself, tiny
    return directory


@contextmanager
def _serve(frontend: Frontend) -> Iterator[openai.OpenAI]:
    with serving(build_app(ServerConfig(served_model_names=(MODEL,)), frontend)) as port:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def scripted(model_directory):
    """The server over a scripted engine that writes ANSWER (seed 0) or CALL (seed 1) in token ids."""
    tokenizer = Tokenizer.from_directory(model_directory)
    engine = FakeEngine([ANSWER, CALL], max_model_len=4096, encode=tokenizer.encode)
    with _serve(Frontend(engine, tokenizer)) as client:
        yield client


def _stream(client, **fields) -> tuple[str, str, list[dict], str | None]:
    return stream_parts(client, MODEL, USER, **fields)


def test_channels_become_reasoning_and_content(scripted):
    response = scripted.chat.completions.create(model=MODEL, messages=USER, seed=0, max_tokens=200)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "It is sunny in Paris."
    assert choice.message.model_extra["reasoning_content"] == "The user wants a sentence."
    assert response.usage.completion_tokens_details.reasoning_tokens > 0
    assert _stream(scripted, seed=0, max_tokens=200) == (
        "The user wants a sentence.", "It is sunny in Paris.", [], "stop"
    )  # fmt: skip


def test_a_commentary_call_is_a_tool_call(scripted):
    response = scripted.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, seed=1, max_tokens=200
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I should look it up."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    reasoning, content, calls, finish = _stream(scripted, tools=TOOLS, seed=1, max_tokens=200)
    assert (reasoning, content, finish) == ("I should look it up.", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    # without tools the call's text is content, never a call
    plain = scripted.chat.completions.create(model=MODEL, messages=USER, seed=1, max_tokens=200).choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls
    assert json.loads(plain.message.content) == {"city": "Paris", "unit": "c"}


@pytest.fixture(scope="module")
def real(model_directory):
    """The server over the real engine running the tiny random-weight harmony model."""
    from serval.config import CacheConfig, EngineConfig, ModelConfig
    from serval.engine.client import EngineClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")  # nothing to compile for a 2-layer model
        config = EngineConfig(
            model=ModelConfig(model=model_directory, dtype="float32"), cache=CacheConfig(num_blocks=256)
        )
        engine = EngineClient.start(config)
        try:
            with _serve(Frontend(engine, Tokenizer.from_directory(model_directory))) as client:
                yield client
        finally:
            engine.shutdown()


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_of_a_random_model_are_valid_harmony_calls(real, tool_choice):
    response = real.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=0, n=3,
        max_tokens=400, extra_body={"thinking_budget": BUDGET},
    )  # fmt: skip
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # streamed, the same request gives the same call
    first = response.choices[0].message.tool_calls[0].function.arguments
    _, _, calls, finish = _stream(real, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=0,
                                  max_tokens=400, extra_body={"thinking_budget": BUDGET})  # fmt: skip
    assert finish == "tool_calls" and [c["arguments"] for c in calls] == [first]


def test_free_text_of_a_random_model_does_not_break_the_parser(real):
    for seed in range(3):
        choice = real.chat.completions.create(
            model=MODEL, messages=USER, temperature=1.0, seed=seed, max_tokens=24, reasoning_effort="low"
        ).choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert not choice.message.tool_calls
