"""Tool calls, structured output and continuation on the default model through the real server and the real
`openai` SDK: forced calls and JSON answers validate against their schemas for 20 seeds at temperature 1
(the grammar makes them valid by construction, however unsure the 135M model is), streamed and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now.", "parameters": {}}},
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SAMPLED = {"temperature": 1.0, "seed": 0, "n": 20, "max_tokens": 120}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": {"type": "object"}}


def _check_call(name: str, arguments: str, expected_name: str | None) -> None:
    assert expected_name is None or name == expected_name
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_validate_for_20_seeds(openai_client, server, tool_choice):
    expected_name = None if tool_choice == "required" else "get_weather"
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, **SAMPLED,
    )  # fmt: skip
    assert len(response.choices) == 20
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls  # parallel_tool_calls false: exactly one
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments, expected_name)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_forced_calls_validate_for_20_seeds(openai_client, server, tool_choice):
    expected_name = None if tool_choice == "required" else "get_weather"
    stream = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, stream=True, **SAMPLED,
    )  # fmt: skip
    calls: dict[tuple[int, int], dict] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                key = (choice.index, piece.index)
                if key not in calls:  # the first delta of a call carries its id and name
                    assert piece.id.startswith("call_") and piece.function.name
                    calls[key] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[key]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == dict.fromkeys(range(20), "tool_calls")
    assert {index for index, _ in calls} == set(range(20))
    for call in calls.values():
        _check_call(call["name"], call["arguments"], expected_name)


def test_parallel_calls_each_validate(openai_client, server):
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
        n=4, max_tokens=160,
    )  # fmt: skip
    for choice in response.choices:
        calls = choice.message.tool_calls
        # a call cut off by max_tokens is the only one allowed to be incomplete
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert [call.index for call in calls] == list(range(len(calls)))
        assert len({call.id for call in calls}) == len(calls)
        for call in complete:
            _check_call(call.function.name, call.function.arguments, None)


GREEDY = {"temperature": 0, "max_tokens": 120}


def _streamed(stream) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)] in index order, finish reasons) of a one-choice stream."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                if piece.id is not None:  # a call's first delta: its id and name
                    assert piece.index not in calls, "two calls with one index"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], finishes


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_choice_is_exactly_one_call_of_that_function(openai_client, server, name):
    # parallel_tool_calls is left at its default (true): a named choice is one call all the same.
    request = {"model": server.model, "messages": QUESTION, "tools": TOOLS, **GREEDY,
               "tool_choice": {"type": "function", "function": {"name": name}}}  # fmt: skip
    _assert_exactly_one_call(openai_client, request, name)


def test_required_without_parallel_calls_is_one_call(openai_client, server):
    request = {"model": server.model, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, **GREEDY}  # fmt: skip
    _assert_exactly_one_call(openai_client, request, None)


def _assert_exactly_one_call(openai_client, request: dict, name: str | None) -> None:
    """The request is answered with exactly one call (of `name` when given) and no content, streamed or not."""
    response = openai_client.chat.completions.create(**request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments, name)
    content, calls, finishes = _streamed(openai_client.chat.completions.create(**request, stream=True))
    assert (content, finishes) == ("", ["tool_calls"])
    assert calls == [(call.function.name, call.function.arguments)]  # greedy: the same call, once


def test_required_parallel_calls_end_instead_of_looping(openai_client, server):
    # After its call the greedy model writes "\n" (the Hermes separator) and then would end; when "\n" could
    # only be a separator, the grammar forced another call and the model repeated calls until max_tokens.
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=200,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert response.usage.completion_tokens < 200
    for call in choice.message.tool_calls:
        _check_call(call.function.name, call.function.arguments, None)


def test_required_cut_by_max_tokens_never_leaks_markup_into_content(openai_client, server):
    # Small budgets end inside `<tool_call>\n{"name": ...` (dropped), larger ones inside the arguments (the
    # call is returned with the arguments written so far); neither shows up as content, streamed or not.
    seen = set()
    for max_tokens in (1, 3, 8, 13, 21, 34):
        request = {"model": server.model, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
                   "temperature": 0, "max_tokens": max_tokens}  # fmt: skip
        choice = openai_client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "length", (max_tokens, choice)
        assert not choice.message.content, (max_tokens, choice.message.content)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        for name, arguments in calls:
            assert name in PARAMETERS and arguments.startswith("{"), (max_tokens, calls)
        seen.add(bool(calls))
        streamed = _streamed(openai_client.chat.completions.create(**request, stream=True))
        assert streamed == ("", calls, ["length"]), max_tokens
    assert seen == {False, True}  # both kinds of cut were exercised


def test_json_schema_answers_validate_for_20_seeds(openai_client, server):
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "name": {"type": "string", "maxLength": 16},
        },
        "required": ["color", "count", "name"],
    }
    response = openai_client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Describe a fruit as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "fruit", "schema": schema, "strict": True},
        },
        **SAMPLED,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        assert set(value) <= set(schema["properties"])  # strict


def test_json_object_is_an_object(openai_client, server):
    response = openai_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A JSON object about a cat, please."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=80,
    )  # fmt: skip
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_tool_choice_none_gives_no_calls_and_hides_the_tools(openai_client, server):
    plain = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=24
    )
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    )
    choice = response.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens  # the same prompt: no tools in it


def test_auto_calls_are_well_formed_when_they_come(openai_client, server):
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, temperature=1.0, seed=3, n=4, max_tokens=60
    )
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                _check_call(call.function.name, call.function.arguments, None)
        else:
            assert not choice.message.tool_calls


def test_tool_results_come_back_for_the_next_turn(openai_client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}  # fmt: skip
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]  # fmt: skip
    response = openai_client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    )
    assert response.choices[0].message.content


@pytest.mark.parametrize("flag", ["prefix", "partial"])
def test_continuation_equals_the_raw_completion_of_the_same_prompt(openai_client, server, flag):
    messages = [
        {"role": "user", "content": "Write one sentence about the sea."},
        {"role": "assistant", "content": "The sea is", flag: True},
    ]
    greedy = {"temperature": 0, "max_tokens": 16}
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": server.model, "messages": messages, **greedy}, timeout=120,
    ).json()  # fmt: skip
    rendered = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": messages, "continue_final_message": True}
    ).json()["tokens"]
    raw = openai_client.completions.create(model=server.model, prompt=rendered, **greedy)
    assert chat["choices"][0]["message"]["content"] == raw.choices[0].text
    assert not chat["choices"][0]["message"]["content"].startswith("The sea is")
