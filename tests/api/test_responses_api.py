"""POST /v1/responses through the official openai SDK against a real server on loopback over a scripted
engine: plain and streamed answers (event names, payloads and sequence numbers the SDK's own stream helper
accepts), a function-call round trip, text.format, max_output_tokens, the store (off by default: refused by
name), and the same answer streamed or not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.agent_fixtures import ADD_SCHEMA, CALL_TEXT, MODEL, openai_client, scripted_server

TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers.", "parameters": ADD_SCHEMA}]


@pytest.fixture(scope="module")
def server():
    with scripted_server(["Hello there.", CALL_TEXT, '{"city": "Paris"}']) as (port, engine):
        yield openai_client(port), engine


@pytest.fixture(scope="module")
def stored():
    with scripted_server(["Hello there.", CALL_TEXT], responses_store_size=2) as (port, engine):
        yield openai_client(port), engine


def test_a_plain_answer(server):
    client, engine = server
    response = client.responses.create(
        model=MODEL, input="Hi!", instructions="Be brief.", max_output_tokens=64
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "Hello there."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    usage = response.usage
    assert usage.input_tokens == len(engine.prompts[-1]) and usage.output_tokens == len("Hello there.") + 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert engine.last_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!")


def test_the_stream_has_the_official_events(server):
    client, _ = server
    events = list(client.responses.create(model=MODEL, input="Hi!", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    assert events[0].response.status == "in_progress" and events[-1].response.output_text == "Hello there."
    # the SDK's stream helper checks every event's identity against what came before
    with client.responses.stream(model=MODEL, input="Hi!") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there."


def test_a_function_call_round_trip(server):
    client, engine = server
    first = client.responses.create(model=MODEL, input="1 + 2?", tools=TOOLS, extra_body={"seed": 1})
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    # streamed, the call's arguments arrive as deltas
    events = list(client.responses.create(model=MODEL, input="1 + 2?", tools=TOOLS, stream=True,
                                          extra_body={"seed": 1}))  # fmt: skip
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == json.loads(done.arguments) == {"a": 1, "b": 2}
    # the client runs the tool and sends the call and its output back
    history = [{"role": "user", "content": "1 + 2?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]  # fmt: skip
    second = client.responses.create(model=MODEL, input=history, tools=TOOLS)
    assert second.output_text == "Hello there."
    prompt = engine.last_prompt
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in prompt  # the call, in the model's format
    assert "<tool_response>\n3\n</tool_response>" in prompt


def test_text_format_json_schema_is_accepted(server):
    client, _ = server
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = client.responses.create(
        model=MODEL, input="Where?", extra_body={"seed": 2},
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_makes_it_incomplete(server):
    client, _ = server
    response = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hello"
    events = list(client.responses.create(model=MODEL, input="Hi!", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "Hello"


def test_the_store_is_off_by_default_and_says_so(server):
    client, _ = server
    for fields, param in (
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=MODEL, input="Hi!", **fields)
        body = error.value.body
        assert body["param"] == param and "--responses-store-size" in body["message"]
    response = client.responses.create(model=MODEL, input="Hi!", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_store_keeps_and_continues_conversations(stored):
    client, engine = stored
    first = client.responses.create(model=MODEL, input="My name is Ada.")
    assert first.store is True and client.responses.retrieve(first.id).output_text == "Hello there."
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id)
    assert "My name is Ada." in engine.last_prompt and "Hello there." in engine.last_prompt
    assert second.previous_response_id == first.id
    streamed = list(client.responses.create(model=MODEL, input="Again?", previous_response_id=second.id,
                                            stream=True))  # fmt: skip
    third_id = streamed[-1].response.id
    assert "What is my name?" in engine.last_prompt and client.responses.retrieve(third_id).id == third_id
    # bounded: two entries, so the first is gone
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    client.responses.delete(third_id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third_id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=third_id)
