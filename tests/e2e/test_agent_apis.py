"""The agent APIs on the default model in a real `serval serve` process: the official openai client's
responses.create and the anthropic client's messages.create, plain and streamed, agree with each other, and
the server is idle (every KV block free) afterwards."""

from __future__ import annotations

import anthropic

from tests.e2e.helpers import wait_until_idle

QUESTION = "Name a colour."


def test_responses_on_the_default_model(server, openai_client):
    response = openai_client.responses.create(model=server.model, input=QUESTION, max_output_tokens=12,
                                              temperature=0.0)  # fmt: skip
    assert response.status in ("completed", "incomplete") and response.output_text
    events = list(openai_client.responses.create(model=server.model, input=QUESTION, max_output_tokens=12,
                                                 temperature=0.0, stream=True))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == response.output_text  # greedy: the same answer
    wait_until_idle(server.base_url)


def test_messages_on_the_default_model(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    body = {"model": server.model, "max_tokens": 12, "messages": [{"role": "user", "content": QUESTION}],
            "extra_body": {"temperature": 0.0}}  # fmt: skip
    message = client.messages.create(**body)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].text
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text
    assert client.messages.count_tokens(model=server.model, messages=body["messages"]).input_tokens > 0
    wait_until_idle(server.base_url)
