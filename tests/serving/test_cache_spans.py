"""Explicit-cache spans: carried beside the messages (never as a marker in their text) through the chat
rewrites (tools in a system prompt, tool results, preserved reasoning) to the renderer, which maps the last
span's end to the token where the pinned prefix ends."""

from __future__ import annotations

import asyncio

import pytest

from serval.serving.chat import ChatOptions, ChatPrompt
from serval.serving.client_text import CacheSpan
from serval.serving.frontend import Frontend
from serval.serving.tool_calls import Tool, ToolChoice
from tests.serving.fakes import ByteTokenizer, FakeEngine

PLAIN = ChatOptions()
TOOLS = ChatOptions(
    tools=(Tool("lookup", {"type": "object", "properties": {}}),), tool_choice=ToolChoice("auto")
)


@pytest.fixture
def frontend() -> Frontend:
    return Frontend(FakeEngine(["ok"]), ByteTokenizer())


def prepared(frontend, messages, spans, options=PLAIN) -> tuple[str, str]:
    """(the pinned prefix's text, the whole prompt's text)."""
    prompt = ChatPrompt(messages, cache_spans=tuple(spans))
    ids, _, num_pinned, _ = asyncio.run(frontend.prepare_chat(prompt, options))
    decode = frontend.tokenizer.decode
    return decode(ids[:num_pinned], skip_special_tokens=False), decode(ids, skip_special_tokens=False)


def whole(frontend, messages, options=PLAIN) -> str:
    return prepared(frontend, messages, [], options)[1]


CASES = [
    # (messages, span, options, the text the pinned prefix ends with)
    ([{"role": "system", "content": "ABCDEF"}, {"role": "user", "content": "hi"}],
     CacheSpan(0, 0, 3), ChatOptions(), "system\nABC"),
    ([{"role": "system", "content": "ABCDEF"}, {"role": "user", "content": "hi"}],
     CacheSpan(0, 0, 6), ChatOptions(), "system\nABCDEF"),
    # Tools go into a new system message first: the span's message moves to index 1.
    ([{"role": "user", "content": "manual text. question?"}],
     CacheSpan(0, 0, 12), TOOLS, "user\nmanual text."),
    # A tool result is wrapped in <tool_response>: the span moves past the wrapper's head.
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "RESULT rest", "tool_call_id": "c1"}],
     CacheSpan(1, 0, 6), ChatOptions(), "<tool_response>\nRESULT"),
    # Preserved reasoning is written before the assistant's text.
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": "ANSWER more", "reasoning_content": "thought"},
      {"role": "user", "content": "again"}],
     CacheSpan(1, 0, 6), ChatOptions(preserve_thinking=True), "thought\n</think>\n\nANSWER"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "span", "options", "ending"), CASES)
def test_the_pinned_prefix_ends_where_the_span_ends(frontend, messages, span, options, ending):
    prefix, text = prepared(frontend, messages, [span], options)
    assert prefix.endswith(ending)
    assert text.startswith(prefix)
    assert text == whole(frontend, messages, options)  # nothing was put into the text
    assert "SERVAL" not in text


def test_the_last_span_counts_and_no_span_pins_nothing(frontend):
    messages = [{"role": "system", "content": "ABCDEF"}, {"role": "user", "content": "question"}]
    prefix, _ = prepared(frontend, messages, [CacheSpan(0, 0, 2), CacheSpan(1, 0, 4)])
    assert prefix.endswith("user\nques")
    assert prepared(frontend, messages, [])[0] == ""
