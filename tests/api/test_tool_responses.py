"""Response shapes of tool calls and reasoning (in process, scripted engine): message.tool_calls,
finish_reason "tool_calls", streamed call deltas (id and name first, then argument pieces), reasoning_content,
and the fallback prompt that shows tools to a template without tool support."""

from __future__ import annotations

import json

import pytest

from serval.server_config import ServerConfig
from tests.api.conftest import MODEL, AppClient
from tests.serving.fakes import FakeEngine

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
CALLS_TEXT = (
    'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
USER = [{"role": "user", "content": "1 + 2?"}]


@pytest.fixture
def make_client():
    """App clients over a scripted engine with room for the tool system prompt (byte tokens are many)."""
    clients = []

    def make(texts: list[str] | None = None) -> AppClient:
        engine = FakeEngine(texts or ["Hello there."], max_model_len=4096)
        clients.append(AppClient(ServerConfig(served_model_names=(MODEL,)), engine))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def chat(client, **fields):
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, **fields) -> list[dict]:
    loop_client = client

    async def read():
        body = {"model": MODEL, "messages": USER, "stream": True, **fields}
        chunks = []
        async with loop_client.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))
        return chunks

    return client.loop.run_until_complete(read())


def test_calls_in_the_message(make_client):
    client = make_client([CALLS_TEXT])
    data = chat(client, tools=TOOLS, max_tokens=300)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me add.\n"  # the text before the first call, as written
    calls = message["tool_calls"]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "add"),
        (1, "function", "now"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_streamed_call_deltas_fold_to_the_message(make_client):
    client = make_client([CALLS_TEXT])
    chunks = stream(client, tools=TOOLS, max_tokens=300)
    pieces = [p for c in chunks for ch in c["choices"] for p in ch["delta"].get("tool_calls", [])]
    firsts = [p for p in pieces if "id" in p]
    assert [(p["index"], p["function"]["name"], p["type"]) for p in firsts] == [
        (0, "add", "function"),
        (1, "now", "function"),
    ]
    assert all(
        set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
        for p in pieces
        if "id" not in p
    )
    arguments = {0: "", 1: ""}
    for piece in pieces:
        arguments[piece["index"]] += piece["function"]["arguments"]
    assert json.loads(arguments[0]) == {"a": 1, "b": 2} and json.loads(arguments[1]) == {}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_leaves_the_text_alone(make_client):
    client = make_client([CALLS_TEXT])
    data = chat(client, tools=TOOLS, tool_choice="none", max_tokens=300)
    assert data["choices"][0]["message"]["content"] == CALLS_TEXT
    assert data["choices"][0]["message"]["tool_calls"] is None
    assert data["choices"][0]["finish_reason"] == "stop"


def test_tools_reach_a_template_without_tool_support_as_a_system_prompt(make_client):
    client = make_client()
    base = client.post("/tokenize", json={"messages": USER}).json()["count"]
    data = chat(client, tools=TOOLS, max_tokens=300)
    # the byte tokenizer counts bytes: the prompt grew by the system prompt listing both tools
    assert data["usage"]["prompt_tokens"] > base + len(json.dumps(TOOLS[0]))
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]  # fmt: skip
    assert chat(client, messages=history, tools=TOOLS, max_tokens=300)["choices"][0]["message"]["content"]


def test_usage_has_reasoning_tokens(make_client):
    data = chat(make_client())
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert "reasoning_content" not in data["choices"][0]["message"]


def _folded_stream(chunks: list[dict]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], finish reasons) of one choice's chunks."""
    content, calls, finishes = "", [], []
    for chunk in chunks:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for piece in choice["delta"].get("tool_calls", []):
                if "id" in piece:
                    calls.append([piece["function"]["name"], ""])
                calls[piece["index"]][1] += piece["function"]["arguments"]
            finishes += [choice["finish_reason"]] if choice["finish_reason"] else []
    return content, [tuple(call) for call in calls], finishes


def test_a_call_cut_by_max_tokens_never_leaks_markup_into_content(make_client):
    # The scripted engine writes one byte per token, so every max_tokens cuts the text at another byte.
    client = make_client([CALLS_TEXT])
    first_call = CALLS_TEXT.index("<tool_call>")
    arguments_at = CALLS_TEXT.index('{"a"')  # where the first call's arguments begin
    for max_tokens in range(1, len(CALLS_TEXT.encode())):
        data = chat(client, tools=TOOLS, max_tokens=max_tokens)
        choice = data["choices"][0]
        message = choice["message"]
        text = CALLS_TEXT[:max_tokens]
        assert choice["finish_reason"] == "length", max_tokens
        assert (message["content"] or "") == text[:first_call], max_tokens  # only the text before the call
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]
        if max_tokens <= arguments_at:
            assert calls == [], max_tokens  # the call had not begun its arguments: dropped
        else:
            assert calls[0][0] == "add" and '{"a": 1, "b": 2}'.startswith(calls[0][1]), max_tokens
            assert all(name in ("add", "now") for name, _ in calls)
        streamed = _folded_stream(stream(client, tools=TOOLS, max_tokens=max_tokens))
        assert streamed == (message["content"] or "", calls, ["length"]), max_tokens
