"""The marker-token tool-call formats (DeepSeek-V3/R1, DeepSeek-V3.1, Kimi-K2, GLM-4.5, MiniMax-M2) and the
reasoning formats: every fixture fed at every split point, and one character at a time, gives the one-shot
parse; text cut short never shows call markup as content; each family's real chat template (tests/fixtures/
templates/) picks its formats; the request's thinking switch reaches each template under its own name."""

from __future__ import annotations

import json

import pytest

from serval.serving.chat_template import ChatTemplate
from serval.serving.output import OutputParser, OutputPlan
from serval.serving.reasoning_formats import REASONING_FORMATS, reasoning_format_for_template
from serval.serving.tool_call_families import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from serval.serving.tool_call_parsers import ContentText, ToolCallArguments, ToolCallStart, merge_events
from serval.serving.tool_calls import FORMATS, Tool, format_for_template
from tests.fixtures.family_templates import template_source

C, S, A = ContentText, ToolCallStart, ToolCallArguments
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = (Tool("get_weather", WEATHER), Tool("f", {"type": "object"}), Tool("g", {}))
NAMES = frozenset(t.name for t in TOOLS)
KIMI_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"


def ds_v3(name: str, arguments: str) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def ds_v31(name: str, arguments: str) -> str:
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{arguments}{DS_CALL_END}"


FIXTURES = {
    "deepseek_v3": [
        (
            (
                f"Let me check.{DS_CALLS_BEGIN}{ds_v3('get_weather', json.dumps({'city': 'Paris'}))}\n"
                f"{ds_v3('f', '{}')}{DS_CALLS_END}"
            ),
            [C("Let me check."), S(0, "get_weather"), A(0, '{"city": "Paris"}'), S(1, "f"), A(1, "{}")],
        ),
        (
            DS_CALLS_BEGIN + ds_v3("g", '{"a": "}```"}') + f"{DS_CALLS_END}\nDone.",
            [S(0, "g"), A(0, '{"a": "}```"}'), C("\nDone.")],
        ),
        (
            f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{"a": 1',
            [S(0, "f"), A(0, '{"a": 1')],
        ),
        (f"Sure. {DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_we", [C("Sure.")]),
        ("Hello <｜tool", [C("Hello <｜tool")]),
    ],
    "deepseek_v31": [
        (
            DS_CALLS_BEGIN
            + ds_v31("get_weather", '{"city": "Paris"}')
            + ds_v31("g", '{"x": [1, "}"]}')
            + DS_CALLS_END,
            [S(0, "get_weather"), A(0, '{"city": "Paris"}'), S(1, "g"), A(1, '{"x": [1, "}"]}')],
        ),
        ("Plain answer.", [C("Plain answer.")]),
    ],
    "kimi_k2": [
        (
            "I'll check.<|tool_calls_section_begin|>"
            + KIMI_CALL.format("get_weather", 0, '{"city": "Paris"}')
            + KIMI_CALL.format("f", 1, "{}")
            + "<|tool_calls_section_end|>",
            [
                C("I'll check."),
                S(0, "get_weather", "functions.get_weather:0"),
                A(0, '{"city": "Paris"}'),
                S(1, "f", "functions.f:1"),
                A(1, "{}"),
            ],
        ),
        (  # the spacing llama.cpp's tests see from the model
            (
                "<|tool_calls_section_begin|>\n<|tool_call_begin|>\nfunctions.get_weather:3<|tool_call_argument_begin|>"
                '\n{"city": "Tokyo"}\n<|tool_call_end|>\n<|tool_calls_section_end|>\n\nLet me get that.'
            ),
            [
                S(0, "get_weather", "functions.get_weather:3"),
                A(0, '{"city": "Tokyo"}'),
                C("\n\nLet me get that."),
            ],
        ),
    ],
    "glm45": [
        (
            (
                '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, "FR" </arg_value>\n'
                "<arg_key>days</arg_key>\n<arg_value> 3\n</arg_value>\n</tool_call>"
            ),
            [S(0, "get_weather"), A(0, '{"city": "Paris, \\"FR\\" ", "days": 3}')],
        ),
        (
            (
                'Checking.\n<tool_call>f\n<arg_key>tags</arg_key>\n<arg_value>["a", 1]</arg_value>\n'
                "<arg_key>note</arg_key>\n<arg_value>not json</arg_value>\n</tool_call>\n<tool_call>g\n</tool_call>"
            ),
            [
                C("Checking."),
                S(0, "f"),
                A(0, '{"tags": ["a", 1], "note": "not json"}'),
                S(1, "g"),
                A(1, "{}"),
            ],
        ),
        (
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</arg_b\nü</arg_value></tool_call>",
            [S(0, "get_weather"), A(0, '{"city": "a</arg_b\\nü"}')],
        ),
        ("a <tool is not a call", [C("a <tool is not a call")]),
    ],
    "minimax_m2": [
        (
            (
                '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="f">\n</invoke>\n</minimax:tool_call>'
            ),
            [S(0, "get_weather"), A(0, '{"city": "Paris", "days": 3}'), S(1, "f"), A(1, "{}")],
        ),
        ("Just text <minimax:", [C("Just text <minimax:")]),
    ],
}
CUT_FIXTURES = {
    "deepseek_v3": [(f"Sure. {DS_CALLS_BEGIN}{DS_CALL_BEGIN}func", [C("Sure.")]), ("Hi <｜tool▁ca", [C("Hi")])],
    "kimi_k2": [("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_", [])],
    "glm45": [
        ("<tool_call>get_wea", []),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", [S(0, "get_weather"), A(0, '{"city": "Par')]),
        ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>1", [S(0, "get_weather"), A(0, '{"days": ')]),
    ],
    "minimax_m2": [("Sure. <minimax:tool_ca", [C("Sure.")])],
}  # fmt: skip


def _parse(tool_format, pieces: list[str], is_cut: bool = False) -> list:
    parser = tool_format.parser(NAMES, TOOLS)
    events = [event for piece in pieces for event in parser.feed(piece)]
    return merge_events(events + parser.finish(is_cut))


def _splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(
    "name, text, expected", [(n, t, e) for n, fixtures in FIXTURES.items() for t, e in fixtures]
)
def test_every_split_gives_the_one_shot_parse(name, text, expected):
    one_shot = _parse(FORMATS[name], [text])
    assert one_shot == merge_events(expected)
    for pieces in _splits(text):
        assert _parse(FORMATS[name], pieces) == one_shot, pieces


@pytest.mark.parametrize(
    "name, text, expected", [(n, t, e) for n, fixtures in CUT_FIXTURES.items() for t, e in fixtures]
)
def test_cut_text_never_shows_call_markup_as_content(name, text, expected):
    for pieces in [[text], *_splits(text)]:
        assert _parse(FORMATS[name], pieces, is_cut=True) == merge_events(expected), pieces


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2"])
def test_calls_written_back_into_the_history_parse_to_the_same_calls(name):
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("g", {"x": [1, {"y": None}]})]
    text = FORMATS[name].history_text([(n, json.dumps(a)) for n, a in calls])
    events = _parse(FORMATS[name], [text])
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather", "g"]
    for index, (_, arguments) in enumerate(calls):
        assert (
            json.loads("".join(e.text for e in events if isinstance(e, A) and e.index == index)) == arguments
        )
    assert not [e for e in events if isinstance(e, ContentText)]


# family's stored template -> (tool-call format, reasoning format)
DETECTED = {
    "deepseek_r1": ("deepseek_v3", "deepseek_r1"),
    "deepseek_v31": ("deepseek_v31", "deepseek_v3"),
    "kimi_k2": ("kimi_k2", None),
    "kimi_k2_thinking": ("kimi_k2", "kimi_k2"),
    "glm46": ("glm45", "glm45"),
    "minimax_m2": ("minimax_m2", "minimax_m2"),
    "chatglm3": ("chatglm3", None),
}


@pytest.mark.parametrize("family", DETECTED)
def test_each_real_template_chooses_its_formats(family):
    source = template_source(family)
    tool_format, reasoning = DETECTED[family]
    assert format_for_template(source).name == tool_format
    found = reasoning_format_for_template(source)
    assert (found.name if found else None) == reasoning
    assert reasoning_format_for_template(source, "qwen3").name == "qwen3"  # the flag overrides
    with pytest.raises(ValueError):
        reasoning_format_for_template(source, "nope")


def _render(family: str, **kwargs) -> str:
    template = ChatTemplate(template_source(family), "<bos>", "<eos>")
    segments = template.render([{"role": "user", "content": "Hi"}], True, False, None, kwargs)
    return "".join(s.text for s in segments)


@pytest.mark.parametrize(
    "family, thinking_prompt, plain_prompt",
    [
        ("deepseek_v31", "<｜Assistant｜><think>", "<｜Assistant｜></think>"),
        ("glm46", "<|assistant|>", "Hi/nothink<|assistant|>\n<think></think>"),
    ],
)
def test_the_thinking_switch_reaches_each_template_under_its_own_name(family, thinking_prompt, plain_prompt):
    reasoning = reasoning_format_for_template(template_source(family))
    for name in ("thinking", "enable_thinking"):
        assert _render(family, **reasoning.template_kwargs({name: True})).endswith(thinking_prompt)
        assert _render(family, **reasoning.template_kwargs({name: False})).endswith(plain_prompt)


def test_minimax_append_think_keeps_the_reasoning_in_content_at_every_split():
    text = "I should call f.\n</think>\n\nDone."
    plan = OutputPlan(parses_reasoning=True, starts_in_reasoning=True, reasoning_in_content=True)

    def run(pieces):
        parser = OutputParser(plan)
        parts = [parser.feed(p, 1) for p in pieces] + [parser.finish()]
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)

    assert REASONING_FORMATS["minimax_m2_append_think"].in_content
    for pieces in [[text], *_splits(text)]:
        assert run(pieces) == ("", "<think>\nI should call f.\n</think>\n\nDone."), pieces
