"""Harmony (gpt-oss): the output parser fed every fixture at every split point gives the one-shot parse; the
harmony template fixture renders reasoning_effort, tools, earlier calls and results through the Frontend
with the tiny harmony tokenizer; harmony is chosen by template or vocabulary; <|return|> and <|call|> end
generation; random walks through the harmony grammars give text that parses to schema-valid calls."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest

from serval.serving import harmony
from serval.serving.chat import ChatOptions, ChatPrompt, ResponseFormat, grammar_spec
from serval.serving.frontend import Frontend
from serval.serving.harmony import HarmonyParser
from serval.serving.output import OutputParser, OutputPlan
from serval.serving.reasoning import ReasoningText
from serval.serving.structured import GrammarCompiler
from serval.serving.tokenizer import Tokenizer
from serval.serving.tool_call_parsers import ContentText, ToolCallArguments, ToolCallStart, merge_events
from serval.serving.tool_calls import FORMATS, Tool, ToolChoice, format_for_template
from tests.fixtures.tiny_models import harmony_template, write_tiny_tokenizer
from tests.serving.fakes import FakeEngine

R, C, S, A = ReasoningText, ContentText, ToolCallStart, ToolCallArguments
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
FIXTURES = [
    (
        "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.",
        [R("Let me think."), C("Paris.")],
    ),
    (
        f'<|channel|>analysis<|message|>Weather?<|end|><|start|>assistant{CALL}{{"city": "Paris"}}<|call|>',
        [R("Weather?"), S(0, "get_weather"), A(0, '{"city": "Paris"}')],
    ),
    # the recipient on the role line, the content type without <|constrain|> (as gpt-oss's template writes)
    (
        ' to=functions.get_weather<|channel|>commentary json<|message|> {"city": "Rome"} ',
        [S(0, "get_weather"), A(0, '{"city": "Rome"}')],
    ),
    (
        (
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.f <|constrain|>json<|message|>{"a": [1, "}<|end|>"]}<|call|>'
        ),
        [C("Checking."), S(0, "f"), A(0, '{"a": [1, "}<|end|>"]}')],
    ),
    ("Hello world, no harmony here.", [C("Hello world, no harmony here.")]),
    (
        "<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B<|return|>",
        [C("A\nB")],
    ),
    # malformed calls and headers are the model's text, shown
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>not json<|call|>", [C("not json")]),
    ("<|channel|><|message|>x", [C("<|channel|><|message|>x")]),
    (
        "<|channel|>analysis<|message|>ünï<|end|><|start|>assistant<|channel|>final<|message|>ök",
        [R("ünï"), C("ök")],
    ),
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", [R("print(1)")]),
    ("<|channel|>commentary to=functions.g <|constrain|>json<|message|><|call|>", [S(0, "g")]),
    ("<|channel|>final<|message|>a <| b", [C("a <| b")]),
    ("<|channel|>final<|message|>done<|return|>\n\n", [C("done")]),
    ("<|channel|>final<|message|>x<|end|>stray", [C("x\nstray")]),
]
# Cut short by max_tokens (finish(is_cut=True)): an unfinished header, terminator or call is markup.
CUT_FIXTURES = [
    ("<|channel|>analysis<|message|>abc<|en", [R("abc")]),
    ("<|channel|>commentary to=functions.get_wea", []),
    (CALL, []),
    (CALL + '{"city": ', [S(0, "get_weather"), A(0, '{"city":')]),
    ("<|channel|>final<|message|>Hi<|end|><|start|>assist", [C("Hi")]),
    ("Hel", [C("Hel")]),
]


def _parse(pieces: list[str], parses_tool_calls: bool = True, is_cut: bool = False, **kwargs) -> list:
    parser = HarmonyParser(parses_tool_calls, **kwargs)
    events = [event for piece in pieces for event in parser.feed(piece)]
    return merge_events(events + parser.finish(is_cut))


def _splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("text, expected", FIXTURES)
def test_every_split_gives_the_one_shot_parse(text, expected):
    assert _parse([text]) == merge_events(expected)
    for pieces in _splits(text):
        assert _parse(pieces) == merge_events(expected), pieces


@pytest.mark.parametrize("text, expected", CUT_FIXTURES)
def test_cut_text_never_shows_markup(text, expected):
    for pieces in [[text], *_splits(text)]:
        assert _parse(pieces, is_cut=True) == merge_events(expected), pieces


def test_without_tools_a_call_is_content_and_a_continued_message_goes_on():
    text = CALL + '{"city": "Paris"}<|call|>'
    for pieces in [[text], *_splits(text)]:
        assert _parse(pieces, parses_tool_calls=False) == [C('{"city": "Paris"}')]
    # continue_final_message: the prompt ended inside a final message, so the output is its text
    prefix = "<|start|>assistant<|channel|>final<|message|>The sea is"
    assert _parse([" wide.<|return|>"], prefix=prefix) == [C(" wide.")]
    assert _parse(["analysis"], prefix="<|start|>assistant") == [C("analysis")]


def test_output_parser_counts_the_analysis_tokens_and_folds_the_call():
    plan = OutputPlan(tool_format=FORMATS["harmony"], harmony_prefix="<|start|>assistant")
    tokens = ["<|channel|>", "analysis", "<|message|>", "a", " b", "<|end|>", "<|start|>", "assistant"]
    tokens += [
        "<|channel|>",
        "commentary to=functions.f",
        " <|constrain|>json",
        "<|message|>",
        '{"x":',
        " 1}",
    ]
    parser = OutputParser(plan)
    parts = [parser.feed(token, 1) for token in tokens] + [parser.finish()]
    assert parser.num_reasoning_tokens == 4  # <|message|> through <|end|>
    assert "".join(p.reasoning for p in parts) == "a b"
    assert "".join(p.content for p in parts) == ""
    calls = [c for p in parts for c in p.tool_calls]
    assert [(c.index, c.name) for c in calls if c.name] == [(0, "f")]
    assert "".join(c.arguments for c in calls) == '{"x": 1}'
    assert plan.keeps_special_tokens and not plan.is_plain


# ---- with the tiny harmony tokenizer and the template fixture


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = str(tmp_path_factory.mktemp("tiny-harmony-tokenizer"))
    write_tiny_tokenizer(directory, harmony=True)
    return Tokenizer.from_directory(directory)


@pytest.fixture(scope="module")
def frontend(tokenizer) -> Frontend:
    return Frontend(FakeEngine([""], max_model_len=4096), tokenizer)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8, "description": "A city."},
           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS = (Tool("get_weather", WEATHER, "The weather now.", strict=True),
         Tool("get_time", {"type": "object", "properties": {}}, strict=True))  # fmt: skip


def test_the_end_of_generation_tokens_are_return_and_call(tokenizer):
    assert sorted(tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids) == ["<|call|>", "<|return|>"]
    # a harmony vocabulary whose configs name <|end|> (a GGUF's eot, llama.cpp's end texts): it only ends a
    # message, so it is dropped
    end, call = tokenizer.encode("<|end|>")[0], tokenizer.encode("<|call|>")[0]
    again = Tokenizer(tokenizer._backend, bos_token_id=0, eos_token_ids=[end], chat_template=None,
                      add_bos_token=False)  # fmt: skip
    assert end not in again.eos_token_ids and call in again.eos_token_ids


def test_harmony_is_chosen_by_template_or_vocabulary(tokenizer, frontend):
    assert format_for_template(harmony_template()).name == "harmony"
    assert format_for_template(None, special_token_texts=tokenizer.special_token_texts).name == "harmony"
    assert format_for_template(
        "{{ '<tool_call>' }}", special_token_texts=tokenizer.special_token_texts
    ).name == ("hermes")  # the template's markers come first
    assert format_for_template(None, "harmony").is_harmony
    assert frontend.tool_format.name == "harmony"


def _prompt(
    frontend: Frontend, messages: list[dict], options: ChatOptions, **kwargs
) -> tuple[str, OutputPlan]:
    loop = asyncio.new_event_loop()
    try:
        ids, plan, _, _ = loop.run_until_complete(
            frontend.prepare_chat(ChatPrompt(messages, **kwargs), options)
        )
    finally:
        loop.close()
    return frontend.tokenizer.decode(ids, skip_special_tokens=False), plan


def test_the_template_renders_effort_tools_and_earlier_calls(frontend, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? <|channel|>final<|message|>"},
        {"role": "assistant", "content": None, "reasoning_content": "I need the weather.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"},
    ]  # fmt: skip
    options = ChatOptions(tools=TOOLS, tool_choice=ToolChoice("auto"))
    text, plan = _prompt(frontend, messages, options, template_kwargs={"reasoning_effort": "high"})
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high\n\n" in text
    assert (
        "# Valid channels: analysis, commentary, final. Channel must be included for every message." in text
    )
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" in text
    assert (
        '// The weather now.\ntype get_weather = (_: {\n// A city.\ncity: string,\nunit: "c" | "f",\n' in text
    )
    assert "type get_time = () => any;" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>" in text
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", '
        '"unit": "c"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
        '"21 degrees"<|end|><|start|>assistant'
    ) in text
    assert text.endswith("<|start|>assistant")
    assert plan.harmony_prefix == "<|start|>assistant" and plan.tool_format is FORMATS["harmony"]
    # the template's markers are special tokens; the user's typed ones stay text
    ids = frontend.render_chat(messages[:2])
    channel = tokenizer.encode("<|channel|>")[0]
    generation_prompt = tokenizer.encode("<|start|>assistant")
    assert ids.count(channel) == 0 and ids[-len(generation_prompt) :] == generation_prompt
    assert "Reasoning: medium" in _prompt(frontend, messages[:2], ChatOptions())[0]


def test_a_continued_final_message_is_the_parser_prefix(frontend):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The sea is"}]
    text, plan = _prompt(frontend, messages, ChatOptions(), add_generation_prompt=False,
                         continue_final_message=True)  # fmt: skip
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>The sea is")
    assert plan.harmony_prefix == "<|start|>assistant<|channel|>final<|message|>The sea is"


def test_the_thinking_budget_ends_the_analysis_message(tokenizer, compiler):
    options = ChatOptions(tools=TOOLS, tool_choice=ToolChoice("function", "get_time"), thinking_budget=3)
    grammar = compiler.compile_now(grammar_spec(options, FORMATS["harmony"], "none"), "tools")
    end_ids = tuple(tokenizer.encode(harmony.budget_end(has_grammar=True)))
    plan = OutputPlan(tool_format=FORMATS["harmony"], grammar=grammar, thinking_budget=3,
                      think_end_token_ids=end_ids, harmony_prefix="<|start|>assistant")  # fmt: skip
    constraint = plan.new_constraint(tokenizer.token_bytes, tokenizer.vocab_size)
    for token_id in tokenizer.encode("<|channel|>analysis<|message|>") + tokenizer.encode("abc")[:2]:
        constraint.accept_token(token_id)
    forced = []
    for _ in end_ids:
        bitmask = constraint.allowed_token_bitmask()
        [token_id] = [i for i in range(tokenizer.vocab_size) if bitmask[i // 32] >> (i % 32) & 1]
        constraint.accept_token(token_id)
        forced.append(token_id)
    assert tuple(forced) == end_ids
    ids = _walk(constraint, tokenizer, 0)  # the grammar goes on with the call
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert (
        text.startswith("<|channel|>commentary to=functions.get_time") and ids[-1] in tokenizer.eos_token_ids
    )


# ---- grammars


def _walk(constraint, tokenizer: Tokenizer, seed: int, max_steps: int = 300) -> list[int]:
    """Sample uniformly among the allowed tokens but the structure tokens (written as plain pieces unless only
    they are allowed); after a few steps of analysis, end it (the tokens of `<|end|><|start|>assistant`), and
    prefer the end of generation once it is allowed late."""
    import torch

    rng = random.Random(seed)
    structure = {tokenizer.encode(t)[0] for t in harmony.STRUCTURE_TOKENS}
    closing = tokenizer.encode("<|end|><|start|>assistant")
    ids: list[int] = []
    is_closing = False
    for step in range(max_steps):
        is_analysis = tokenizer.decode(ids, skip_special_tokens=False).startswith(
            "<|channel|>analysis<|message|>"
        )
        bitmask = constraint.allowed_token_bitmask()
        bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        allowed = bits[: tokenizer.vocab_size].nonzero().flatten().tolist()
        assert allowed, "the grammar left no token allowed"
        stops = [t for t in allowed if t in tokenizer.eos_token_ids]
        others = [
            t for t in allowed if t not in stops and t not in structure and t != tokenizer.encode("\t")[0]
        ]
        if closing and closing[0] in allowed and (is_closing or (step > 12 and is_analysis)):
            token, is_closing = closing.pop(0), True
        elif stops and (step > 40 or not others):
            token = stops[0]
        else:
            token = rng.choice(others or [t for t in allowed if t not in stops])
        constraint.accept_token(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return ids


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, text_tokens=frozenset(harmony.STRUCTURE_TOKENS))


def _parsed(tokenizer: Tokenizer, ids: list[int], plan: OutputPlan):
    text = tokenizer.decode(
        ids[:-1] if ids[-1] in tokenizer.eos_token_ids else ids, skip_special_tokens=False
    )
    parser = OutputParser(plan)
    return text, [parser.feed(text, len(ids)), parser.finish()]


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_forced_calls_are_harmony_calls_with_valid_arguments(tokenizer, compiler, choice):
    options = ChatOptions(tools=TOOLS, tool_choice=choice)
    grammar = compiler.compile_now(grammar_spec(options, FORMATS["harmony"], "none"), "tools")
    plan = OutputPlan(tool_format=FORMATS["harmony"], tool_names=frozenset({"get_weather", "get_time"}),
                      harmony_prefix="<|start|>assistant")  # fmt: skip
    for seed in range(8):
        ids = _walk(grammar.new_constraint(), tokenizer, seed)
        assert ids[-1] in tokenizer.eos_token_ids, tokenizer.decode(ids, skip_special_tokens=False)
        text, parts = _parsed(tokenizer, ids, plan)
        assert "<|channel|>commentary to=functions." in text
        calls = [c for p in parts for c in p.tool_calls]
        [name] = [c.name for c in calls if c.name]
        assert choice.mode != "function" or name == "get_weather"
        arguments = json.loads("".join(c.arguments for c in calls))
        jsonschema.validate(arguments, WEATHER if name == "get_weather" else {"type": "object"})
        assert not "".join(p.content for p in parts).strip(), text


def test_a_json_answer_is_a_final_message(tokenizer, compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    options = ChatOptions(response_format=ResponseFormat("json_schema", schema))
    grammar = compiler.compile_now(grammar_spec(options, FORMATS["harmony"], "none"))
    plan = OutputPlan(harmony_prefix="<|start|>assistant")
    for seed in range(8):
        ids = _walk(grammar.new_constraint(), tokenizer, seed)
        text, parts = _parsed(tokenizer, ids, plan)
        assert "<|channel|>final<|message|>" in text
        jsonschema.validate(json.loads("".join(p.content for p in parts)), schema)


def test_auto_leaves_text_free_until_a_call_opens(tokenizer, compiler):
    options = ChatOptions(tools=TOOLS, tool_choice=ToolChoice("auto"))
    spec = grammar_spec(options, FORMATS["harmony"], "none")
    assert spec["format"]["type"] == "triggered_tags"
    constraint = compiler.compile_now(spec, "tools").new_constraint()
    text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + CALL
    for token_id in tokenizer.encode(text):
        assert not constraint.matcher.is_terminated()
        constraint.accept_token(token_id)
    assert not constraint.is_rejected
    # now only schema-valid arguments may follow: a walk ends in a call
    ids = tokenizer.encode(text) + _walk(constraint, tokenizer, 0)
    plan = OutputPlan(tool_format=FORMATS["harmony"], harmony_prefix="<|start|>assistant")
    _, parts = _parsed(tokenizer, ids, plan)
    calls = [c for p in parts for c in p.tool_calls]
    jsonschema.validate(json.loads("".join(c.arguments for c in calls)), WEATHER)
