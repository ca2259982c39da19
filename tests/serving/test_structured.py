"""Grammars on the byte tokenizer: schema checks name what cannot be enforced; random walks through the
allowed tokens always give schema-valid JSON and well-formed tool calls; the thinking budget forces the end
tag; a grammar and a budget compose."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from serval.serving.chat import ChatOptions, ResponseFormat, grammar_spec
from serval.serving.errors import InvalidRequestError
from serval.serving.output import OutputParser, OutputPlan
from serval.serving.reasoning import ThinkingBudget
from serval.serving.structured import GrammarCompiler, check_schema
from serval.serving.tool_calls import FORMATS, Tool, ToolChoice
from tests.serving.fakes import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                               "required": ["city"]}, strict=True)  # fmt: skip
TIME = Tool("get_time", {"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer())


def allowed_ids(bitmask: torch.Tensor | None, vocab_size: int) -> list[int]:
    if bitmask is None:
        return list(range(vocab_size))
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def random_walk(constraint, seed: int, max_steps: int = 400, prefer: list[int] | None = None) -> list[int]:
    """Sample uniformly among allowed tokens (preferring EOS after a while, so walks end)."""
    tokenizer = ByteTokenizer()
    rng = random.Random(seed)
    ids: list[int] = []
    for step in range(max_steps):
        allowed = allowed_ids(constraint.allowed_token_bitmask(), tokenizer.vocab_size)
        assert allowed, "a grammar left no token allowed"
        eos = [t for t in allowed if t in tokenizer.eos_token_ids]
        # NOTE: no tabs: xgrammar admits a raw tab inside a length-bounded string (structured.py).
        others = [t for t in allowed if t not in eos and t != ord("\t")]
        token = eos[0] if eos and step > 60 else rng.choice(others or eos)
        constraint.accept_token(token)
        ids.append(token)
        if constraint.is_finished or token in tokenizer.eos_token_ids:
            break
    return ids


def text_of(ids: list[int]) -> str:
    return ByteTokenizer().decode(ids)


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "if"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
        ({"$defs": {"x": {"dependentRequired": {"a": ["b"]}}}}, "dependentRequired"),
    ],
)
def test_unenforceable_keywords_are_refused_by_name(schema, keyword):
    with pytest.raises(InvalidRequestError, match=keyword):
        check_schema(schema, "response_format")


def test_annotations_and_enforceable_keywords_pass():
    check_schema({"title": "t", "description": "d", "x-vendor": 1, **SCHEMA}, "response_format")
    with pytest.raises(InvalidRequestError, match="larger"):
        check_schema({"enum": ["x" * 70000]}, "response_format")


@pytest.mark.parametrize("seed", range(8))
def test_json_schema_walks_are_valid(compiler, seed):
    grammar = compiler.compile_now({"type": "json_schema", "schema": SCHEMA, "strict": True})
    ids = random_walk(grammar.new_constraint(), seed)
    assert ids[-1] in ByteTokenizer.eos_token_ids
    value = json.loads(text_of(ids))
    jsonschema.validate(value, SCHEMA)
    assert set(value) <= set(SCHEMA["properties"])  # strict: no other keys


def test_uncompilable_schema_is_a_400_with_the_reason(compiler):
    with pytest.raises(InvalidRequestError, match="minProperties"):
        compiler.compile_now(
            {"type": "json_schema", "schema": {"type": "object", "minProperties": 2}, "strict": True}
        )


@pytest.mark.parametrize("mode", ["required", "function"])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_parse_and_validate(compiler, mode, parallel):
    hermes = FORMATS["hermes"]
    choice = ToolChoice(mode, "get_weather" if mode == "function" else None)
    options = ChatOptions(tools=(WEATHER, TIME), tool_choice=choice, parallel_tool_calls=parallel)
    grammar = compiler.compile_now(grammar_spec(options, hermes, "none"))
    plan = OutputPlan(tool_format=hermes, tool_names=frozenset({"get_weather", "get_time"}), grammar=grammar)
    for seed in range(4):
        ids = random_walk(grammar.new_constraint(), seed)
        parser = OutputParser(plan)
        parts = [parser.feed(text_of(ids[:-1]), len(ids)), parser.finish()]
        calls = [c for p in parts for c in p.tool_calls]
        assert calls and not "".join(p.content for p in parts).strip()
        assert len(calls) == 1 or (parallel and mode == "required")  # a named choice is one call
        for call in calls:
            assert mode != "function" or call.name == "get_weather"
            tool = WEATHER if call.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.arguments), tool.parameters)


EOS = ByteTokenizer.eos_token_ids[0]
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def accept_text(constraint, text: str) -> None:
    for byte in text.encode():
        assert byte in allowed_ids(constraint.allowed_token_bitmask(), 258), (text, chr(byte))
        constraint.accept_token(byte)


@pytest.mark.parametrize(
    "choice, parallel",
    [(ToolChoice("function", "get_time"), True), (ToolChoice("function", "get_time"), False),
     (ToolChoice("required"), False)],
)  # fmt: skip
def test_a_named_choice_or_a_single_required_call_ends_after_one_call(compiler, choice, parallel):
    options = ChatOptions(tools=(WEATHER, TIME), tool_choice=choice, parallel_tool_calls=parallel)
    constraint = compiler.compile_now(grammar_spec(options, FORMATS["hermes"], "none")).new_constraint()
    accept_text(constraint, TIME_CALL)
    assert allowed_ids(constraint.allowed_token_bitmask(), 258) == [EOS]  # no second call, no whitespace


def test_required_parallel_calls_may_end_after_any_call(compiler):
    options = ChatOptions(tools=(WEATHER, TIME), tool_choice=ToolChoice("required"))
    grammar = compiler.compile_now(grammar_spec(options, FORMATS["hermes"], "none"))
    constraint = grammar.new_constraint()
    assert EOS not in allowed_ids(constraint.allowed_token_bitmask(), 258)  # at least one call
    for _ in range(3):
        accept_text(constraint, TIME_CALL)
        assert EOS in allowed_ids(constraint.allowed_token_bitmask(), 258)
        accept_text(constraint, "\n")
        # The separator is also the newline a model writes before it ends: the end stays allowed after it.
        allowed = allowed_ids(constraint.allowed_token_bitmask(), 258)
        assert EOS in allowed and ord("<") in allowed
    # trailing whitespace is bounded: then only the end
    constraint = grammar.new_constraint()
    accept_text(constraint, TIME_CALL + "\n \n ")
    assert allowed_ids(constraint.allowed_token_bitmask(), 258) == [EOS]
    # and the calls still parse: whitespace after them is not content
    plan = OutputPlan(tool_format=FORMATS["hermes"], tool_names=frozenset({"get_weather", "get_time"}))
    parser = OutputParser(plan)
    parts = [parser.feed(f"{TIME_CALL}\n{TIME_CALL}\n", 1), parser.finish()]
    assert [c.name for p in parts for c in p.tool_calls] == ["get_time", "get_time"]
    assert not "".join(p.content for p in parts)


def test_tool_choice_auto_is_free_text_until_the_tag(compiler):
    hermes = FORMATS["hermes"]
    options = ChatOptions(tools=(WEATHER,), tool_choice=ToolChoice("auto"))
    grammar = compiler.compile_now(grammar_spec(options, hermes, "none"))
    constraint = grammar.new_constraint()
    for byte in b"Sure. ":
        assert byte in allowed_ids(constraint.allowed_token_bitmask(), 258)
        constraint.accept_token(byte)
    for byte in b'<tool_call>\n{"name": "':
        constraint.accept_token(byte)
    # inside the call only the offered names may follow
    assert allowed_ids(constraint.allowed_token_bitmask(), 258) == [ord("g")]
    assert not constraint.is_finished


def test_thinking_budget_forces_the_end_tag_then_the_grammar_continues(compiler):
    tokenizer = ByteTokenizer()
    options = ChatOptions(response_format=ResponseFormat("json_schema", SCHEMA))
    grammar = compiler.compile_now(grammar_spec(options, FORMATS["hermes"], "open"))
    end_ids = tokenizer.encode("\n</think>\n\n")
    budget = ThinkingBudget(
        5, end_ids, tokenizer.token_bytes, tokenizer.vocab_size, True, grammar.new_constraint()
    )
    ids = random_walk(budget, seed=3)
    assert ids[5 : 5 + len(end_ids)] == end_ids  # five free tokens, then the end tag, forced
    assert budget.counter.num_reasoning_tokens == 5 + len(tokenizer.encode("\n</think>"))
    jsonschema.validate(json.loads(text_of(ids).split("</think>")[1]), SCHEMA)
