"""POST /v1/messages through the official anthropic SDK against a real server on loopback over a scripted
engine: plain and streamed messages (the SDK's own stream accumulator), a tool_use -> tool_result round trip,
stop_sequences, max_tokens, count_tokens, x-api-key auth, and Anthropic's error shape on these routes."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.api.agent_fixtures import ADD_SCHEMA, API_KEY, CALL_TEXT, MODEL, anthropic_client, scripted_server

TOOLS = [{"name": "add", "description": "Add two numbers.", "input_schema": ADD_SCHEMA}]
USER = [{"role": "user", "content": "1 + 2?"}]


@pytest.fixture(scope="module")
def server():
    with scripted_server(["Hello there.", CALL_TEXT], api_keys=(API_KEY,)) as (port, engine):
        yield anthropic_client(port, API_KEY), engine, port


def test_a_plain_message(server):
    client, engine, _ = server
    message = client.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=USER)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == len(engine.prompts[-1]) and message.usage.output_tokens == 13
    assert message.usage.cache_read_input_tokens == 0
    assert engine.last_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 2?")


def test_a_streamed_message_folds_to_the_same(server):
    client, _, port = server
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.text for b in final.content] == ["Hello there."] and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 13
    raw = [
        event.type for event in client.messages.create(model=MODEL, max_tokens=64, messages=USER, stream=True)
    ]
    assert raw[:2] == ["message_start", "content_block_start"]  # the SDK drops pings
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/messages", json=body,
                      headers={"x-api-key": API_KEY}) as response:  # fmt: skip
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]


def test_a_tool_use_round_trip(server):
    client, engine, _ = server
    # the scripted engine picks its text by seed, which the Messages API has not: put the call first
    engine.texts.reverse()
    try:
        message = client.messages.create(model=MODEL, max_tokens=300, messages=USER, tools=TOOLS)
        with client.messages.stream(model=MODEL, max_tokens=300, messages=USER, tools=TOOLS) as stream:
            streamed = stream.get_final_message()
    finally:
        engine.texts.reverse()
    assert message.stop_reason == "tool_use" == streamed.stop_reason
    text, call = message.content
    assert text.type == "text" and text.text == "Let me add.\n"
    assert call.type == "tool_use" and call.name == "add" and call.input == {"a": 1, "b": 2}
    assert call.id.startswith("toolu_")
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [("text", None),
                                                                             ("tool_use", {"a": 1, "b": 2})]  # fmt: skip
    history = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "3"},
                                            {"type": "text", "text": "Thanks."}]}]  # fmt: skip
    answer = client.messages.create(model=MODEL, max_tokens=64, messages=history, tools=TOOLS)
    assert answer.content[0].text == "Hello there."
    prompt = engine.last_prompt
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in prompt
    assert "<tool_response>\n3\n</tool_response>" in prompt and prompt.index("3\n</tool") < prompt.index(
        "Thanks."
    )


def test_stop_sequences_and_max_tokens(server):
    client, _, _ = server
    message = client.messages.create(model=MODEL, max_tokens=64, messages=USER, stop_sequences=["there"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "there"
    assert message.content[0].text == "Hello "
    with client.messages.stream(
        model=MODEL, max_tokens=64, messages=USER, stop_sequences=["there"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "there")
    cut = client.messages.create(model=MODEL, max_tokens=5, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "Hello"


def test_count_tokens(server):
    client, engine, _ = server
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    client.messages.create(model=MODEL, max_tokens=4, messages=USER, system="Be brief.")
    assert counted.input_tokens == len(engine.prompts[-1])
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens  # the tools' system prompt counts


def test_auth_and_errors_speak_anthropic(server):
    client, _, port = server
    url = f"http://127.0.0.1:{port}/v1/messages"
    body = {"model": MODEL, "messages": USER, "max_tokens": 4}
    for headers in ({}, {"x-api-key": "wrong"}):
        response = httpx.post(url, json=body, headers=headers)
        assert response.status_code == 401
        assert (
            response.json()["type"] == "error" and response.json()["error"]["type"] == "authentication_error"
        )
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, messages=USER, max_tokens=None)  # type: ignore[arg-type]
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "max_tokens: Field required"}}  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="other", messages=USER, max_tokens=4)
    assert error.value.body["error"]["type"] == "not_found_error"
