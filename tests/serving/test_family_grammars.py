"""The marker-token formats' grammars, compiled by xgrammar without a model: a forced call admits the
family's well-formed call text (as its chat template writes it) and refuses a malformed one; random walks
through the allowed tokens always give calls that parse back and validate against the tool's schema; under
"auto" text is free until the family's opening marker. Markers that are special tokens in the vocabulary
(Kimi-K2's) are written as those tokens."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from serval.serving.chat import ChatOptions, grammar_spec
from serval.serving.output import OutputParser, OutputPlan
from serval.serving.structured import GrammarCompiler
from serval.serving.tokenizer import Tokenizer
from serval.serving.tool_calls import FORMATS, Tool, ToolChoice
from tests.fixtures.family_templates import write_family_tokenizer
from tests.serving.fakes import ByteTokenizer
from tests.serving.test_structured import accept_text, allowed_ids

FAMILIES = ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                  "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
WEATHER = Tool("get_weather", WEATHER_SCHEMA, strict=True)
TIME = Tool("get_time", {"type": "object", "properties": {}, "additionalProperties": False}, strict=True)
TOOLS = (WEATHER, TIME)
EOS = ByteTokenizer.eos_token_ids[0]
VOCAB = ByteTokenizer.vocab_size


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer())


def _constraint(compiler, name: str, choice: ToolChoice, parallel: bool = False):
    options = ChatOptions(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    return compiler.compile_now(grammar_spec(options, FORMATS[name], "none")).new_constraint()


def _accepts(constraint, text: str) -> bool:
    for byte in text.encode():
        if byte not in allowed_ids(constraint.allowed_token_bitmask(), VOCAB):
            return False
        constraint.accept_token(byte)
    return True


@pytest.mark.parametrize("name", FAMILIES)
def test_a_named_choice_admits_the_well_formed_call_and_then_only_the_end(compiler, name):
    call = FORMATS[name].history_text([("get_weather", json.dumps({"city": "Paris", "days": 3}))])
    constraint = _constraint(compiler, name, ToolChoice("function", "get_weather"))
    accept_text(constraint, call)
    assert allowed_ids(constraint.allowed_token_bitmask(), VOCAB) == [EOS]


MALFORMED = {
    "invalid arguments": lambda f: f.history_text([("get_weather", json.dumps({"city": "Rome", "days": 3}))]),
    "another tool": lambda f: f.history_text([("get_time", "{}")]),
    "hermes syntax": lambda f: (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    ),
    "text first": lambda f: "Sure. " + f.history_text([("get_weather", '{"city": "Paris", "days": 3}')]),
}


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("case", MALFORMED)
def test_a_named_choice_refuses_a_malformed_call(compiler, name, case):
    constraint = _constraint(compiler, name, ToolChoice("function", "get_weather"))
    assert not _accepts(constraint, MALFORMED[case](FORMATS[name]))


def _walk(constraint, seed: int, max_steps: int = 600) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    for step in range(max_steps):
        allowed = allowed_ids(constraint.allowed_token_bitmask(), VOCAB)
        others = [t for t in allowed if t != EOS and t != ord("\t")]
        token = EOS if EOS in allowed and (step > 40 or not others) else rng.choice(others)
        constraint.accept_token(token)
        ids.append(token)
        if token == EOS:
            break
    return ids


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_of_random_walks_parse_back_and_validate(compiler, name, parallel):
    plan = OutputPlan(tool_format=FORMATS[name], tool_names=frozenset(t.name for t in TOOLS), tools=TOOLS)
    for seed in range(4):
        ids = _walk(_constraint(compiler, name, ToolChoice("required"), parallel), seed)
        assert ids[-1] == EOS
        parser = OutputParser(plan)
        parts = [parser.feed(ByteTokenizer().decode(ids[:-1]), len(ids)), parser.finish()]
        calls = [c for p in parts for c in p.tool_calls]
        assert calls and not "".join(p.content for p in parts).strip(), parts
        assert parallel or len(calls) == 1
        for call in calls:
            tool = WEATHER if call.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.arguments), tool.parameters)


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_is_free_text_until_the_opening_marker(compiler, name):
    constraint = _constraint(compiler, name, ToolChoice("auto"))
    accept_text(constraint, "Sure, <b>bold</b> text. ")
    accept_text(constraint, FORMATS[name].trigger)
    # inside the calls only the family's call syntax may follow: not more free text
    assert not _accepts(constraint, "Hello")


def test_kimi_markers_that_are_special_tokens_are_written_as_those_tokens(tmp_path):
    tokenizer = Tokenizer.from_directory(write_family_tokenizer(str(tmp_path), "kimi_k2"))
    kimi = FORMATS["kimi_k2"]
    compiler = GrammarCompiler(tokenizer, text_tokens=frozenset(kimi.markup))
    try:
        options = ChatOptions(tools=TOOLS, tool_choice=ToolChoice("function", "get_time"))
        constraint = compiler.compile_now(grammar_spec(options, kimi, "none")).new_constraint()
        [section_begin] = tokenizer.encode("<|tool_calls_section_begin|>")
        assert section_begin in tokenizer.special_token_ids
        # the marker's token (its bytes spelled by ordinary tokens are text too, as for any marker)
        assert section_begin in allowed_ids(constraint.allowed_token_bitmask(), tokenizer.vocab_size)
        for token_id in tokenizer.encode(kimi.history_text([("get_time", "{}")])):
            assert token_id in allowed_ids(constraint.allowed_token_bitmask(), tokenizer.vocab_size)
            constraint.accept_token(token_id)
        assert allowed_ids(constraint.allowed_token_bitmask(), tokenizer.vocab_size) == list(
            tokenizer.eos_token_ids[:1]
        )
    finally:
        compiler.shutdown()
