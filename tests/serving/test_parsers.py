"""The incremental parsers (tool-call formats, <think>) fed every fixture at every split point, and one
character at a time, give the one-shot parse."""

from __future__ import annotations

import json

import pytest

from serval.serving.output import OutputParser, OutputPlan
from serval.serving.reasoning import AnswerText, ReasoningText, ReasoningTokenCounter, ThinkParser
from serval.serving.tool_call_parsers import ContentText, ToolCallArguments, ToolCallStart, merge_events
from serval.serving.tool_calls import FORMATS, format_for_template

NAMES = frozenset({"get_weather", "f", "g"})
C, S, A = ContentText, ToolCallStart, ToolCallArguments

TOOL_FIXTURES = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
            [S(0, "get_weather"), A(0, '{"city": "Paris", "unit": "c"}')],
        ),
        (
            (
                'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": "x}y\\"z", "b": [1, {"c": 2}]}}\n'
                '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n'
            ),
            [
                C("Let me check.\n"),
                S(0, "f"),
                A(0, '{"a": "x}y\\"z", "b": [1, {"c": 2}]}'),
                S(1, "g"),
                A(1, "{}"),
            ],
        ),
        ("a < b <tool", [C("a < b <tool")]),
        (
            'héllo <tool_call>{"arguments": 1}</tool_call> wörld',
            [C('héllo <tool_call>{"arguments": 1}</tool_call> wörld')],
        ),
        (
            '<tool_call>{"name":"f","arguments":{"k":"ü"}}</tool_call>done',
            [S(0, "f"), A(0, '{"k":"ü"}'), C("done")],
        ),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1', [S(0, "f"), A(0, '{"a": 1')]),
        # a call that ended before its arguments began is markup: dropped, not content
        ('Sure. <tool_call>\n{"name": "get_wea', [C("Sure. ")]),
        ('<tool_call>\n{"name": "f", "arguments": ', []),
        ("<tool_call> is a tag", [C("<tool_call> is a tag")]),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {"x": 1}}', [S(0, "f"), A(0, '{"x": 1}')]),
        (
            '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "}"}}',
            [S(0, "f"), A(0, '{"x": 1}'), S(1, "g"), A(1, '{"y": "}"}')],
        ),
        ("Hello {not json", [C("Hello {not json")]),
        ('  {"foo": 1}', [C('  {"foo": 1}')]),
        ('{"name": "f", "parameters": {}}\nThat is all.', [S(0, "f"), A(0, "{}"), C("\nThat is all.")]),
        ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', [S(0, "f"), A(0, '{"x": 1}')]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 2}}',
            [S(0, "f"), A(0, "{}"), S(1, "g"), A(1, '{"y": 2}')],
        ),
        ("<|python_tag|>print(1)", [C("print(1)")]),
        ("<|python", [C("<|python")]),
        ('{"name": "f", "param', []),
        ('{"name": "f", "parameters": {}}; {"na', [S(0, "f"), A(0, "{}")]),
        ('{"foo": 1', [C('{"foo": 1')]),
    ],
    "glm": [
        ('get_weather\n{"city": "Beijing"}', [S(0, "get_weather"), A(0, '{"city": "Beijing"}')]),
        ("Hello there\nsecond line", [C("Hello there\nsecond line")]),
        ("get_weather", [C("get_weather")]),
    ],
    "chatglm3": [
        (
            'get_weather\n ```python\ntool_call(city="Beijing", days=3, metric=True, extra=None)\n```',
            [S(0, "get_weather"), A(0, '{"city": "Beijing", "days": 3, "metric": true, "extra": null}')],
        ),
        (
            "f\n```python\ntool_call(tags=['a', 'ü'], nested={'k': (1, 2)})\n```\n",
            [S(0, "f"), A(0, '{"tags": ["a", "ü"], "nested": {"k": [1, 2]}}')],
        ),
        ('get_weather\n{"city": "Beijing"}', [S(0, "get_weather"), A(0, '{"city": "Beijing"}')]),
        ("f\n```python\nprint('hi')\n```", [C("f\n```python\nprint('hi')\n```")]),
        ("f\n```python\ntool_call(x=len('a'))\n```", [C("f\n```python\ntool_call(x=len('a'))\n```")]),
        ("f\n```python\ntool_call(x=1", [C("f\n```python\ntool_call(x=1")]),
        ("Hello there\nsecond line", [C("Hello there\nsecond line")]),
    ],
}


def _parse(make, pieces: list[str]) -> list:
    parser = make()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return merge_events(events + parser.finish())


def _splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(
    "format_name, text, expected",
    [(name, text, expected) for name, fixtures in TOOL_FIXTURES.items() for text, expected in fixtures],
)
def test_tool_call_parser_every_split_gives_the_one_shot_parse(format_name, text, expected):
    tool_format = FORMATS[format_name]
    make = lambda: tool_format.parser(NAMES)
    one_shot = _parse(make, [text])
    assert one_shot == merge_events(expected)
    for pieces in _splits(text):
        assert _parse(make, pieces) == one_shot, pieces


# Text cut short by max_tokens (finish(is_cut=True)): what had only begun a call is dropped; a call whose
# arguments began keeps them as written; plain text stays text.
CUT_FIXTURES = {
    "hermes": [
        ("Sure. <tool_c", [C("Sure. ")]),
        ("<", []),
        ('<tool_call>\n{"name', []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": ', [S(0, "f"), A(0, '{"a": ')]),
        (
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_ca',
            [S(0, "f"), A(0, "{}")],
        ),
        ("a < b", [C("a < b")]),
    ],
    "llama3_json": [
        ("<|pyth", []),
        ('{"name": "f", "parameters": {"x": [1', [S(0, "f"), A(0, '{"x": [1')]),
        ('{"foo": 1', [C('{"foo": 1')]),
    ],
    "glm": [
        ("get_w", []),
        ("get_weather\n", []),
        ('get_weather\n{"ci', [S(0, "get_weather"), A(0, '{"ci')]),
        ("Hello", [C("Hello")]),
    ],
    "chatglm3": [
        ("f\n```python\ntool_call(x=1", []),
        ("f\n```python\ntool_call(x=1)\n```", [S(0, "f"), A(0, '{"x": 1}')]),
    ],
}


@pytest.mark.parametrize(
    "format_name, text, expected",
    [(name, text, expected) for name, fixtures in CUT_FIXTURES.items() for text, expected in fixtures],
)
def test_cut_text_never_shows_call_markup_as_content(format_name, text, expected):
    tool_format = FORMATS[format_name]
    for pieces in [[text], *_splits(text)]:
        parser = tool_format.parser(NAMES)
        events = [event for piece in pieces for event in parser.feed(piece)]
        assert merge_events(events + parser.finish(is_cut=True)) == merge_events(expected), pieces


def test_grammar_made_calls_parse_back_for_every_format():
    # What the structural tag admits (begin + arguments + end) is what the parser reads.
    for tool_format in FORMATS.values():
        calls = [("f", {"a": [1, "}"]}), ("g", {})]
        if tool_format.is_single_call:
            calls = calls[:1]
        text = tool_format.history_text([(n, json.dumps(a)) for n, a in calls])
        events = _parse(lambda f=tool_format: f.parser(NAMES), [text])
        starts = [e.name for e in events if isinstance(e, ToolCallStart)]
        assert starts == [n for n, _ in calls], (tool_format.name, events)
        for index, (_, arguments) in enumerate(calls):
            text_of = "".join(e.text for e in events if isinstance(e, ToolCallArguments) and e.index == index)
            assert json.loads(text_of) == arguments
        assert not any(isinstance(e, ContentText) and e.text.strip() for e in events), events


def test_format_is_chosen_by_the_template():
    assert format_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert format_for_template("<|python_tag|>{{ tools }}").name == "llama3_json"
    assert format_for_template("<|observation|>").name == "glm"
    assert format_for_template("[gMASK]<sop>{{ '<|observation|>' }}").name == "glm"
    assert format_for_template("[gMASK]sop<|{{ role }}|>{{ '<|observation|>' }}").name == "chatglm3"
    assert format_for_template(None).name == "hermes"
    assert format_for_template(None, "glm").name == "glm"
    with pytest.raises(ValueError):
        format_for_template(None, "nope")


THINK_FIXTURES = [
    ("<think>\nabc\n</think>\n\nanswer", False, "abc", "answer"),
    ("abc </think>answer", True, "abc", "answer"),
    ("  plain answer", False, "", "plain answer"),
    ("<thinking is fun", False, "", "<thinking is fun"),
    ("<think>still thinking", False, "still thinking", ""),
    ("<think></think>answer", False, "", "answer"),
    ("<think>a</thin b</think> c", False, "a</thin b", "c"),
    ("ünïcode </think> ök", True, "ünïcode", "ök"),
]


def _think(pieces: list[str], starts_in_reasoning: bool) -> tuple[str, str]:
    parser = ThinkParser(starts_in_reasoning)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningText))
    answer = "".join(e.text for e in events if isinstance(e, AnswerText))
    return reasoning, answer


@pytest.mark.parametrize("text, starts_in_reasoning, reasoning, answer", THINK_FIXTURES)
def test_think_parser_every_split_gives_the_one_shot_parse(text, starts_in_reasoning, reasoning, answer):
    assert _think([text], starts_in_reasoning) == (reasoning, answer)
    for pieces in _splits(text):
        assert _think(pieces, starts_in_reasoning) == (reasoning, answer), pieces


def test_reasoning_tokens_count_up_to_the_end_tag():
    counter = ReasoningTokenCounter(starts_in_reasoning=False)
    for token in ["\n", "<think>", "a", " b", "</think>", "\n\n", "answer"]:
        counter.feed(token)
    assert counter.num_reasoning_tokens == 5  # the whitespace before <think> through </think>
    counter = ReasoningTokenCounter(starts_in_reasoning=False)
    for token in [" ", "no", " thinking"]:
        counter.feed(token)
    assert counter.num_reasoning_tokens == 0


def test_output_parser_splits_reasoning_then_tool_calls_at_every_split():
    plan = OutputPlan(parses_reasoning=True, tool_format=FORMATS["hermes"], tool_names=NAMES)
    text = (
        '<think>I should call f.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )

    def run(pieces):
        parser = OutputParser(plan)
        parts = [parser.feed(p, 1) for p in pieces] + [parser.finish()]
        calls = [(c.index, c.name) for p in parts for c in p.tool_calls if c.name]
        arguments = "".join(c.arguments for p in parts for c in p.tool_calls)
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts), calls, arguments

    expected = ("I should call f.", "", [(0, "f")], '{"a": 1}')
    for pieces in [[text], *_splits(text)]:
        assert run(pieces) == expected, pieces
